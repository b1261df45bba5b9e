"""``apriel2-convert``: an HF Apriel2 checkpoint to the orbax format the engine loads directly.

    apriel2-convert SRC DST [--placement NAME|MIXERS ...] [--dtype bfloat16] [--tp N] [--verify] [--force]

* ``--placement`` thins a supernet: every stochastic layer keeps only the mixers the given placements use (a
  name from ``placements.json`` or one mixer per layer, comma-separated; repeat the flag to keep several).
  A layer left with one mixer becomes a plain mixer of that type; the written ``config.json`` says so.
* ``--tp N`` stores the tensors in the mesh layout of N devices (``apriel2_jax.sharding``), so a load at
  ``tensor_parallel=N`` restores each device's rows straight from disk. ``--tp 1`` (default) loads at any size.
* Everything is checked before anything is written (missing, unexpected, mis-shaped or non-float tensors,
  unreadable or truncated files, unknown placements), the output is assembled beside ``DST`` and renamed into
  place at the end, and a failure, Ctrl-C or SIGTERM removes it: ``DST`` is either complete or untouched. The
  partial output (``.DST.partial-*``) of a run killed outright (SIGKILL, a crash) is removed by the next
  conversion to ``DST``; a lock held while it is written tells it from a live run's.
* ``DST`` is a new directory in an existing one or, with ``--force``, an empty directory or an earlier conversion
  (recognised by its manifest): never the source, a directory holding it or inside it, a file or another directory.
* The converted checkpoint keeps every named placement whose mixers it holds (``placements.json``, written over
  its layers that are still stochastic), so ``--placement NAME`` selects the same mixers there as on the source.

Errors in the command or its inputs exit with status 2; an internal failure (a bug) exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from apriel2_jax.checkpoint import DTYPES, check_tensors, expected_parameters
from apriel2_jax.config import ConfigError, StochasticConfig, load_config, parse_config
from apriel2_jax.orbax_checkpoint import FORMAT, MANIFEST, VERSION, is_converted, read_group, tensor_group, write_group
from apriel2_jax.placement import PlacementError, load_placements, resolve_placement
from apriel2_jax.safetensors_io import CheckpointError, index_checkpoint, read_tensor
from apriel2_jax.sharding import ShardingError, plan_tensor_parallel, read_shard
from convert.thinning import source_key, thin

# Files a checkpoint directory carries besides its weights, copied as they are.
AUX_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
)


class ConversionError(RuntimeError):
    """A problem with the command line or its inputs: reported on stderr, exit status 2."""


class InternalError(ConversionError):
    """A bug in the conversion, not in its inputs: exit status 1."""


# ----------------------------------------------------------------------------------------------------------------
# Placements


def _parse_placements(specs: Sequence[str], config, named: dict, source: str) -> list[tuple[str, tuple]]:
    out = []
    for spec in specs:
        try:
            if spec in named or "," not in spec:
                out.append((spec, resolve_placement(config, spec, named)))
            else:
                names = [n.strip() or None for n in spec.split(",")]
                out.append((spec, resolve_placement(config, [None if n in ("-", "none") else n for n in names])))
        except PlacementError as err:
            raise ConversionError(f"--placement {spec!r} does not fit {source}: {err}") from None
    return out


# ----------------------------------------------------------------------------------------------------------------
# Source and target


def _check_source(source: str) -> None:
    if not os.path.isdir(source):
        raise ConversionError(f"{source}: not a directory (expected an HF Apriel2 checkpoint directory)")
    if is_converted(source):
        raise ConversionError(
            f"{source} is already a converted apriel2-jax checkpoint (it has {MANIFEST}): load it directly "
            f"(apriel2-generate/apriel2-serve {source}); apriel2-convert reads HF checkpoints"
        )


def _inside(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory and path != directory


def _earlier_conversion(target: str) -> str | None:
    """None if ``target`` is an earlier conversion (the only directory --force replaces), else why it is not."""
    if not is_converted(target):
        return f"it has no {MANIFEST}"
    try:
        with open(os.path.join(target, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        return f"its {MANIFEST} is unreadable ({err})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"its {MANIFEST} is not an apriel2-jax manifest (format is not {FORMAT!r})"
    return None


def _check_target(source: str, target: str, force: bool) -> None:
    """Refuse every ``target`` whose writing or replacing could lose data, --force or not: only a new directory in
    an existing one will do, or, with --force, an empty directory or an earlier conversion."""
    real_source, real_target = os.path.realpath(source), os.path.realpath(target)  # symlinks cannot hide the source
    if real_target == real_source:
        raise ConversionError(f"DST {target} is the source checkpoint; give a new directory for the conversion")
    if _inside(real_source, real_target):
        raise ConversionError(
            f"DST {target} contains the source checkpoint {source}; replacing it would delete the source: give a new "
            f"directory for the conversion"
        )
    if _inside(real_target, real_source):
        raise ConversionError(
            f"DST {target} is inside the source checkpoint {source}; the conversion does not write into its source: "
            f"give a directory outside it"
        )
    cwd = os.path.realpath(os.getcwd())
    if real_target == cwd or _inside(cwd, real_target):  # replacing it would pull the shell's directory away
        raise ConversionError(f"DST {target} is the current directory or holds it; give a new directory")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ConversionError(f"the parent directory of DST, {parent}, {what}; apriel2-convert creates only DST itself")
    if os.path.islink(target):
        raise ConversionError(f"DST {target} is a symbolic link; give the path of a directory, not a link")
    if not os.path.exists(target):
        return
    if not os.path.isdir(target):
        raise ConversionError(
            f"DST {target} exists and is not a directory; apriel2-convert replaces only an earlier conversion, even "
            f"with --force: give a new path or remove it yourself"
        )
    why = _earlier_conversion(target) if os.listdir(target) else None  # an empty directory: nothing to lose
    if why is not None:
        raise ConversionError(
            f"DST {target} exists and is not an apriel2-jax conversion ({why}); apriel2-convert replaces only an "
            f"earlier conversion, even with --force: give a new directory or remove it yourself"
        )
    if not force:
        raise ConversionError(
            f"{target} exists; pass --force to replace it (an earlier conversion or an empty directory)"
        )


# ----------------------------------------------------------------------------------------------------------------
# Conversion


class Progress:
    """Progress over tensors and bytes on stderr: on a terminal one line redrawn at most every 0.2 s; elsewhere (a
    log file, a pipe) a plain line every 10 s and at the end."""

    def __init__(self, label: str, tensors: int, nbytes: int, stream=None):
        self.label, self.tensors, self.nbytes = label, tensors, nbytes
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.redraw = bool(isatty and isatty())
        self.done = self.done_bytes = 0
        self.start = self.last = time.monotonic()

    def update(self, nbytes: int) -> None:
        self.done += 1
        self.done_bytes += nbytes
        now = time.monotonic()
        finished = self.done == self.tensors
        if now - self.last >= (0.2 if self.redraw else 10.0) or finished:
            self.last = now
            width = 24
            filled = int(width * self.done_bytes / max(self.nbytes, 1))
            line = (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.tensors} tensors, "
                    f"{_size(self.done_bytes)}/{_size(self.nbytes)}, {now - self.start:.1f}s")
            if self.redraw:
                print(f"\r{line}", end="\n" if finished else "", file=self.stream, flush=True)
            else:
                print(line, file=self.stream, flush=True)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _target_dtype(var_dtype, stored, dtype) -> np.dtype:
    """Parameters the model keeps in fp32 stay fp32; the others take ``dtype`` (None: as stored)."""
    if np.dtype(var_dtype) == np.float32 and dtype is not None and np.dtype(dtype) != np.float32:
        return np.dtype(np.float32)
    return np.dtype(stored if dtype is None else dtype)


def _mesh_layout(array: np.ndarray, plan, key: str) -> np.ndarray:
    shard = plan.tensor(key)
    if plan.tp == 1 or shard.axis is None:
        return array
    return np.concatenate([read_shard(array, shard, d) for d in range(plan.tp)], axis=shard.axis)


def convert(
    source: str,
    target: str,
    *,
    placements: Sequence[str] = (),
    dtype: str | None = None,
    tp: int = 1,
    verify: bool = False,
    force: bool = False,
    log=lambda msg: print(msg, file=sys.stderr, flush=True),
) -> dict:
    """Convert ``source`` (an HF Apriel2 directory) to ``target``; returns the manifest written."""
    source, target = os.path.abspath(source), os.path.abspath(target)
    _check_source(source)
    _check_target(source, target, force)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    np_dtype = None if dtype is None else np.dtype(DTYPES[dtype])

    # Everything is validated before anything is written.
    config_path = os.path.join(source, "config.json")
    config = load_config(source)
    with open(config_path) as f:
        raw = json.load(f)
    found = index_checkpoint(source)
    _, _, source_expected = expected_parameters(config)
    check_tensors(source, config, found, source_expected)
    named = load_placements(source) if os.path.exists(os.path.join(source, "placements.json")) else {}
    chosen = _parse_placements(placements, config, named, source)
    renames: dict[str, str] = {}
    out_raw, keep = raw, None
    if chosen:
        if not config.is_supernet:
            raise ConversionError(f"--placement thins a supernet, but {config_path} has no stochastic layer")
        keep = [None if chosen[0][1][i] is None else {pl[i] for _, pl in chosen} for i in range(config.num_blocks)]
        out_raw, renames = thin(raw, config, keep)
    try:
        out_config = parse_config(out_raw, source=config_path)
        plan = plan_tensor_parallel(out_config, tp)
    except (ConfigError, ShardingError) as err:
        raise ConversionError(str(err)) from None
    _, _, expected = expected_parameters(out_config, jnp.bfloat16)  # bf16 model: fp32 variables are kept fp32
    sources = {key: source_key(key, renames) for key in expected}
    absent = sorted(k for k, s in sources.items() if s not in found)
    if absent:  # a thinning bug, not a user error: the check above found every source tensor
        raise InternalError(f"no source tensor for {absent[:5]}")
    out_placements = _kept_placements(named, config, out_config, chosen, keep)

    parent, name = os.path.split(target)
    _remove_stale_staging(parent, name, log)
    staging = os.path.join(parent, f".{name}.partial-{socket.gethostname()}-{os.getpid()}")
    with _owned(staging):
        try:
            shutil.rmtree(staging, ignore_errors=True)  # a dead run's of the same name (the lock is ours now)
            os.makedirs(staging)
            manifest = _write(source, staging, found, expected, sources, plan, np_dtype, dtype, out_raw,
                              out_placements, chosen, log)
            if verify:
                _verify(staging, found, expected, sources, plan, np_dtype, manifest, log)
            with _signals_deferred():  # the swap runs to its end: DST is complete or as it was
                if os.path.exists(target):
                    _replace(target, staging, os.path.join(parent, f".{name}.replaced-{os.getpid()}"), log)
                else:
                    os.rename(staging, target)
        except BaseException:
            with _signals_deferred():
                shutil.rmtree(staging, ignore_errors=True)
            raise
    return manifest


@contextlib.contextmanager
def _signals_deferred():
    """Ctrl-C and SIGTERM held until the block ends (then raised as usual)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _try_lock(path: str) -> int | None:
    """An exclusive lock on ``path`` (created if missing): its descriptor, or None while another process holds it.
    The kernel drops a lock when its process ends however it ends, so a lock that can be taken marks an owner that
    is gone (flock works across the clients of a shared filesystem too, where process ids and host names do not
    tell one machine's or container's runs from another's)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def _owned(staging: str):
    """Holds ``staging``'s lock (``staging + ".lock"``) while the conversion writes it, so that another conversion
    to the same target can tell a live partial output from a dead run's."""
    lock = staging + ".lock"
    fd = _try_lock(lock)
    if fd is None:  # the name has our host and pid: only a process of another pid namespace (a container) could
        raise ConversionError(f"{lock} is held by another process; is another apriel2-convert writing here?")
    try:
        yield
    finally:
        os.unlink(lock)
        os.close(fd)


# A partial output without its lock file (written by a version before the lock, or whose lock file was deleted)
# counts as a dead run's once nothing has touched it for this long.
UNLOCKED_STALE_SECONDS = 3600


def _remove_stale_staging(parent: str, name: str, log) -> None:
    """Delete the partial outputs of earlier conversions to this target that died without cleaning up (SIGKILL, a
    crash, a power loss): nothing else would ever delete them. A partial output whose lock its owner still holds
    is left alone."""
    prefix = f".{name}.partial-"
    for entry in sorted(os.listdir(parent)):
        path = os.path.join(parent, entry)
        if not entry.startswith(prefix) or entry.endswith(".lock") or os.path.islink(path) or not os.path.isdir(path):
            continue
        fd = None
        try:
            if os.path.exists(path + ".lock"):
                fd = _try_lock(path + ".lock")
                if fd is None:
                    continue  # a live conversion's
            elif time.time() - os.path.getmtime(path) < UNLOCKED_STALE_SECONDS:
                continue
        except OSError:  # gone meanwhile (its run just finished) or not ours to open: left alone
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            if fd is not None:
                os.unlink(path + ".lock")
        finally:
            if fd is not None:
                os.close(fd)
        if os.path.exists(path):
            log(f"apriel2-convert: warning: could not delete {path}, the partial output of an earlier run that did "
                f"not finish; delete it yourself")
        else:
            log(f"apriel2-convert: removed {path}, the partial output of an earlier run that did not finish")


def _replace(target: str, staging: str, old: str, log) -> None:
    """Swap the complete ``staging`` in for ``target`` (an earlier conversion or an empty directory, as
    ``_check_target`` ensured) and delete the old one: on any failure before the swap ``target`` is put back."""
    os.rename(target, old)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(old, target)
        raise
    try:
        shutil.rmtree(old)
    except OSError as err:  # the new conversion is in place; only the old one's removal failed
        log(f"apriel2-convert: warning: could not delete the replaced conversion, moved to {old} ({err}); "
            f"delete it yourself")


def _kept_placements(named: dict, config, out_config, chosen, keep) -> dict:
    """The named placements (from the source's placements.json, and the --placement mixer lists under their
    spelling) whose every mixer the converted model keeps, each as {layer: mixer} over the converted model's
    stochastic layers: by name, each selects on the converted model the mixers it selects on the source."""
    out = {}
    for name, spec in list(named.items()) + [(label, list(p)) for label, p in chosen if label not in named]:
        try:
            resolved = resolve_placement(config, spec)
        except PlacementError:
            continue  # an entry of the source's placements.json that does not fit the source itself
        if keep is not None and any(m is not None and m not in keep[i] for i, m in enumerate(resolved)):
            continue  # needs a mixer the thinning dropped
        # Only the layers still stochastic on the converted model: one the thinning left with a single mixer is a
        # fixed layer of that mixer there (which a placement names by its type or not at all).
        translated = {str(i): m for i, m in enumerate(resolved)
                      if m is not None and isinstance(out_config.blocks[i].mixer, StochasticConfig)}
        try:
            resolve_placement(out_config, translated)
        except PlacementError as err:
            raise InternalError(f"placement {name!r} does not fit the thinned model: {err}") from None
        out[name] = translated
    return out


def _tensor(found, key, source_key, expected_var, plan, np_dtype) -> np.ndarray:
    info = found[source_key]
    array = np.asarray(read_tensor(info))
    array = array.astype(_target_dtype(expected_var.dtype, array.dtype, np_dtype), copy=False)
    if not np.isfinite(array.astype(np.float32)).all():
        raise CheckpointError(f"{info.file}: tensor {source_key} holds NaN or infinite values (corrupt file?)")
    return _mesh_layout(array, plan, key)


def _write(source, staging, found, expected, sources, plan, np_dtype, dtype, out_raw, out_placements, chosen, log):
    groups: dict[str, list[str]] = {}
    for key in sorted(expected):
        groups.setdefault(tensor_group(key), []).append(key)
    nbytes = sum(int(np.prod(found[s].shape)) * found[s].dtype.itemsize for s in sources.values())
    progress = Progress("converting", len(expected), nbytes)
    tensors_meta = {}
    for group in sorted(groups):
        tensors = {}
        for key in groups[group]:
            array = _tensor(found, key, sources[key], expected[key], plan, np_dtype)
            tensors[key] = array
            tensors_meta[key] = {"shape": list(array.shape), "dtype": array.dtype.name, "source": sources[key]}
            info = found[sources[key]]
            progress.update(int(np.prod(info.shape)) * info.dtype.itemsize)
        write_group(staging, group, tensors)
    with open(os.path.join(staging, "config.json"), "w") as f:
        json.dump(out_raw, f, indent=2)
    if out_placements:
        with open(os.path.join(staging, "placements.json"), "w") as f:
            json.dump(out_placements, f, indent=1)
    for aux in AUX_FILES:
        if os.path.exists(os.path.join(source, aux)):
            shutil.copy2(os.path.join(source, aux), os.path.join(staging, aux))
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "source": source,
        "tensor_parallel": plan.tp,
        "dtype": dtype or "as stored",
        "placements": [label for label, _ in chosen],
        "tensors": tensors_meta,
    }
    with open(os.path.join(staging, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    log(f"wrote {len(expected)} tensors in {len(groups)} groups (tensor_parallel={plan.tp})")
    return manifest


def _verify(staging, found, expected, sources, plan, np_dtype, manifest, log) -> None:
    """Reload every tensor from the written checkpoint and compare it with a fresh conversion of its source."""
    import jax

    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    groups: dict[str, dict] = {}
    for key, meta in manifest["tensors"].items():
        groups.setdefault(tensor_group(key), {})[key] = jax.ShapeDtypeStruct(tuple(meta["shape"]), np.dtype(meta["dtype"]), sharding=cpu)
    sizes = {k: int(np.prod(m["shape"])) * np.dtype(m["dtype"]).itemsize for k, m in manifest["tensors"].items()}
    progress = Progress("verifying ", len(expected), sum(sizes.values()))
    for group in sorted(groups):
        restored = read_group(staging, group, groups[group])
        for key, array in restored.items():
            want = _tensor(found, key, sources[key], expected[key], plan, np_dtype)
            got = np.asarray(array)
            if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
                raise InternalError(f"verification failed: {key} reloaded from {staging} differs from {sources[key]}")
            progress.update(sizes[key])
    log(f"verified {len(expected)} tensors")


# ----------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="apriel2-convert",
        description="Convert an HF Apriel2 checkpoint (single or sharded safetensors) to the orbax checkpoint the "
        "apriel2-jax engine loads directly, optionally thinned to placements and laid out for tensor parallelism.",
        epilog="Errors in the command or its inputs exit with status 2; an internal failure exits with status 1.",
    )
    parser.add_argument("source", metavar="SRC", help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("target", metavar="DST", help="output directory: a new one in an existing directory (or an "
                        "earlier conversion with --force)")
    parser.add_argument("--placement", action="append", default=[], metavar="NAME|MIXERS",
                        help="keep only the mixers of this placement: a name from placements.json or one mixer per "
                        "layer, comma-separated; repeat to keep the union of several")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="store weights in this dtype (default: as in the source; fp32 gate parameters stay fp32; "
                        "the engine computes in float32 or bfloat16 and casts float16 weights on load)")
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="lay the tensors out for a mesh of N devices (default 1: loads at any size)")
    parser.add_argument("--verify", action="store_true", help="reload every tensor and compare it with the source")
    parser.add_argument("--force", action="store_true", help="replace DST if it is an earlier apriel2-convert output "
                        "or an empty directory (only once the new one is complete); any other existing DST is refused")
    return parser


class _Terminated(BaseException):
    """SIGTERM (a plain ``kill``, a batch scheduler's time limit), raised where the conversion is so that its
    cleanup runs as for Ctrl-C."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse already printed usage and the message (or --help)
        return exit_.code if isinstance(exit_.code, int) else 2
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        return _run(args)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args) -> int:
    try:
        start = time.monotonic()
        convert(args.source, args.target, placements=args.placement, dtype=args.dtype, tp=args.tp,
                verify=args.verify, force=args.force)
    except InternalError as err:
        print(f"apriel2-convert: internal error: {err}", file=sys.stderr)
        return 1
    except (ConversionError, CheckpointError, ConfigError, ShardingError, PlacementError, OSError) as err:
        # Exit status 2, as apriel2-generate: a user error (OSError: an unreadable source, an unwritable DST...).
        print(f"apriel2-convert: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # convert() already removed its partial output
        print("apriel2-convert: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except _Terminated:
        print("apriel2-convert: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    print(f"apriel2-convert: {args.target} written in {time.monotonic() - start:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
