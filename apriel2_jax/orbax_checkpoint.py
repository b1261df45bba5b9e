"""The converted checkpoint format: orbax PyTree checkpoints that the engine loads straight onto its devices.

A converted directory holds the HF-side files (``config.json``, ``placements.json`` with the named placements
it keeps, tokenizer files), a manifest ``apriel2_jax.json``, and ``params/<group>/``: one orbax checkpoint per
group of tensors (the embedding, each decoder layer, the final norm and head), so that neither conversion nor
loading ever holds more than one layer on the host. Tensors are stored in the mesh layout of the
tensor-parallel size they were converted for (``apriel2_jax.sharding``; size 1 is the HF layout), so a load at
that size restores each device's block directly from disk.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import jax
import numpy as np

from .safetensors_io import CheckpointError

MANIFEST = "apriel2_jax.json"
FORMAT = "apriel2-jax-orbax"
VERSION = 1
PARAMS = "params"


def is_converted(directory: str | os.PathLike) -> bool:
    return os.path.exists(os.path.join(os.fspath(directory), MANIFEST))


def tensor_group(key: str) -> str:
    """The orbax checkpoint a tensor lives in."""
    if key.startswith("model.decoder.blocks."):
        return f"layer_{int(key.split('.')[3]):04d}"
    if key.startswith("model.embed_tokens."):
        return "embed"
    return "head"


def _nested(flat: dict[str, object]) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            out.update(_flat(value, key + "."))
        else:
            out[key] = value
    return out


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def write_group(directory: str, group: str, tensors: dict[str, np.ndarray]) -> None:
    """One group's tensors as an orbax checkpoint under ``directory/params/group``."""
    checkpointer = _checkpointer()
    try:
        checkpointer.save(os.path.abspath(os.path.join(directory, PARAMS, group)), _nested(tensors))
    finally:
        # close() waits for orbax's background writers, also when interrupted, so that they stop writing into a
        # directory the caller then deletes (a writer started in the instant before an interrupt may still escape
        # it: apriel2-convert's next run removes what such a writer leaves).
        checkpointer.close()


def read_group(directory: str, group: str, targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """Restore one group; ``targets`` give each tensor's shape, dtype (cast on restore) and sharding."""
    path = os.path.abspath(os.path.join(directory, PARAMS, group))
    if not os.path.isdir(path):
        raise CheckpointError(f"{directory}: the manifest lists tensor group {group!r}, but {path} is missing")
    try:
        restored = _checkpointer().restore(path, _nested(targets))
    except Exception as err:  # orbax/tensorstore raise many types for unreadable data
        raise CheckpointError(f"{path}: cannot restore tensor group {group!r} ({type(err).__name__}: {err})") from None
    return _flat(restored)


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read the manifest ({err})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}; this apriel2-jax reads "
            f"{FORMAT!r} version {VERSION}"
        )
    for field in ("tensor_parallel", "tensors"):
        if field not in manifest:
            raise CheckpointError(f"{path}: the manifest has no {field!r}")
    return manifest


def restore_tensors(
    directory: str,
    targets: dict[str, jax.ShapeDtypeStruct],
    progress: Callable[[int, int, str], None] | None = None,
) -> dict[str, jax.Array]:
    """Every tensor of ``targets`` (checkpoint key -> shape, dtype, sharding), group by group."""
    manifest = read_manifest(directory)
    stored = manifest["tensors"]
    missing = sorted(set(targets) - set(stored))
    wrong = sorted(
        f"{k}: stored {stored[k]['shape']}, model expects {list(targets[k].shape)}"
        for k in set(targets) & set(stored)
        if list(stored[k]["shape"]) != list(targets[k].shape)
    )
    if missing or wrong:
        lines = [f"converted checkpoint {directory} does not match its config.json:"]
        lines += [f"  missing: {k}" for k in missing] + [f"  wrong shape: {w}" for w in wrong]
        raise CheckpointError("\n".join(lines))
    groups: dict[str, dict] = {}
    for key, target in targets.items():
        groups.setdefault(tensor_group(key), {})[key] = target
    out: dict[str, jax.Array] = {}
    for group in sorted(groups):
        out.update(read_group(directory, group, groups[group]))
        if progress is not None:
            progress(len(out), len(targets), group)
    return out


__all__ = ["MANIFEST", "FORMAT", "VERSION", "is_converted", "read_group", "read_manifest", "restore_tensors",
           "tensor_group", "write_group"]
