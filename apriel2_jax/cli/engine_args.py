"""Model and engine flags shared by the command-line tools (``apriel2-generate``, ``apriel2-serve``), and the
``LLM`` keyword arguments they stand for. No JAX import: parsers are built before anything is loaded."""

from __future__ import annotations

import argparse
import math
import re

from ..engine.defaults import DEFAULTS, WARM_UP_CHOICES

KV_CONNECTOR_BACKENDS = ("host", "disk")
_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """Bytes from ``"512M"``, ``"4G"``, ``"1.5G"``, ``"1048576"`` (binary units, an optional trailing B/iB)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size such as 512M, 4G or 1073741824, got {text!r}")
    value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be > 0 bytes, got {text!r}")
    return value


def number_type(kind, low, high=None, low_open=False, high_open=False):
    """An argparse type: ``kind`` (int or float) within ``low`` .. ``high`` (``low_open``/``high_open``: the bound
    excluded), so that a bad value is reported against its flag before anything loads."""
    noun = "an integer" if kind is int else "a number"
    bounds = [f"{'>' if low_open else '>='} {low}"]
    if high is not None:
        bounds.append(f"{'<' if high_open else '<='} {high}")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if (value < low or (low_open and value == low)
                or (high is not None and (value > high or (high_open and value == high)))):
            raise argparse.ArgumentTypeError(f"expected {noun} {' and '.join(bounds)}, got {text!r}")
        return value

    return parse


positive_int = number_type(int, 1)
non_negative_int = number_type(int, 0)
positive_float = number_type(float, 0.0, low_open=True)


def parse_placement(value: str | None, named: dict):
    """A placements.json name, or a comma-separated list with one mixer name per layer ('-'/'none' for fixed)."""
    if value is None or value in named or "," not in value:
        return value
    return [None if name.strip().lower() in ("", "-", "none") else name.strip() for name in value.split(",")]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--placement", default=None, metavar="NAME",
                   help="a placement name from the checkpoint's placements.json, or a comma-separated mixer name per "
                        "layer (for fixed layers '-', 'none' or the layer's type: attention/attn, sliding_window/swa, "
                        "gdn, kda, mamba; a list that starts with '-' is written --placement=-,...); default: every "
                        "layer's main mixer")
    g.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="weights/compute dtype (default bfloat16)")
    g.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                   help="split the model over N devices (heads, MLP channels and vocabulary; default 1)")


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that join several processes (hosts) into one mesh: every process runs the same command with its own
    --process-id; process 0 writes the results."""
    g = parser.add_argument_group("several processes (a tensor-parallel mesh across hosts)")
    g.add_argument("--distributed", action="store_true",
                   help="join the other processes of a SLURM or Open MPI job (they supply the settings below)")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's host and a free port; with --num-processes and --process-id")
    g.add_argument("--num-processes", type=positive_int, default=None, metavar="P",
                   help="how many processes run the command")
    g.add_argument("--process-id", type=non_negative_int, default=None, metavar="I",
                   help="this process's index in [0, P)")


def join_processes(args) -> bool:
    """Join the other processes when the flags ask for it (before anything touches a device); True if joined.
    ``DistributedError`` (a ``ValueError``) names a missing or bad flag."""
    settings = (args.coordinator_address, args.num_processes, args.process_id)
    if not args.distributed and all(value is None for value in settings):
        return False
    from ..distributed import initialize

    initialize(*settings, names={"coordinator_address": "--coordinator-address",
                                 "num_processes": "--num-processes", "process_id": "--process-id"})
    return True


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    d = DEFAULTS
    g.add_argument("--max-num-seqs", type=positive_int, default=d.max_num_seqs,
                   help=f"sequences decoded together (default {d.max_num_seqs})")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context length: prompt + generated tokens (default: the model's max_position_embeddings)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=d.max_num_batched_tokens,
                   help=f"token budget of a prefill step, padding included (default {d.max_num_batched_tokens})")
    g.add_argument("--max-chunk", type=positive_int, default=None,
                   help="longest prefill chunk of one sequence (default: --max-num-batched-tokens)")
    g.add_argument("--max-prefill-rows", type=positive_int, default=None,
                   help="sequences prefilled in one step (default: --max-num-seqs)")
    g.add_argument("--decode-steps", type=positive_int, default=d.decode_steps,
                   help=f"tokens per sequence one decode dispatch may generate (default {d.decode_steps}; "
                   "fewer while requests wait to be prefilled)")
    g.add_argument("--chain-decode", action=argparse.BooleanOptionalAction, default=d.chain_decode,
                   help="queue the next decode dispatch before reading the current one while no request can join "
                        "the decode batch, overlapping host work with the device (default on; --no-chain-decode: "
                        "one dispatch at a time)")
    g.add_argument("--chain-prefill", action=argparse.BooleanOptionalAction, default=d.chain_prefill,
                   help="queue the next prefill step before reading the current one while no request decodes, "
                        "overlapping host work with the device (default on; --no-chain-prefill: one step at a "
                        "time)")
    g.add_argument("--page-size", type=positive_int, default=d.page_size, help=f"tokens per KV-cache page (default {d.page_size})")
    g.add_argument("--cache-memory-fraction", type=number_type(float, 0.0, 1.0, low_open=True),
                   default=d.cache_memory_fraction,
                   help=f"fraction of free device memory for the caches (default {d.cache_memory_fraction})")
    g.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=d.prefix_caching,
                   help="reuse the attention pages and recurrent-state snapshots of prompts that share a prefix "
                        "(default on; --no-prefix-caching turns it off)")
    g.add_argument("--snapshot-memory-fraction", type=number_type(float, 0.0, 1.0, high_open=True),
                   default=d.snapshot_memory_fraction,
                   help="share of the cache budget for the prefix cache's recurrent-state snapshots "
                        f"(default {d.snapshot_memory_fraction})")
    g.add_argument("--snapshot-interval", type=non_negative_int, default=d.snapshot_interval, metavar="TOKENS",
                   help="prefill chunks of placements with recurrent layers also end at multiples of this, leaving "
                        f"state snapshots there (a multiple of --page-size; 0: off; default {d.snapshot_interval})")
    g.add_argument("--warm-up", choices=WARM_UP_CHOICES, default=d.warm_up,
                   help="step shapes compiled before serving: 'few' (default: decode at 1 and at --max-num-seqs "
                        "rows), 'all', or 'none'; the others compile when first needed (a log line says so), "
                        "and that time then counts in the reported timings")
    g.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="persistent compilation cache directory (default: $APRIEL2_JAX_CACHE_DIR, else "
                        "~/.cache/apriel2-jax/xla); 'off' disables it")

    g = parser.add_argument_group("external KV connector (needs prefix caching)")
    g.add_argument("--kv-connector", choices=KV_CONNECTOR_BACKENDS, default=None,
                   help="keep computed prefixes (attention pages and recurrent-state snapshots) outside the device "
                        "too: 'host' (a bounded LRU in host memory) or 'disk' (one checksummed file per entry under "
                        "--kv-connector-path, reusable by later runs); default: none")
    g.add_argument("--kv-connector-path", default=None, metavar="DIR",
                   help="directory of the disk connector (created if missing)")
    g.add_argument("--kv-connector-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="capacity of the connector store, e.g. 16G (host: required; disk: default unbounded)")
    g.add_argument("--kv-load-timeout", type=positive_float, default=DEFAULTS.kv_load_timeout, metavar="SECONDS",
                   help="a load from the connector taking longer is abandoned and its prefix recomputed "
                        f"(default {DEFAULTS.kv_load_timeout})")


def kv_connector_store(args):
    """The connector store the flags ask for (None without --kv-connector); ``ValueError`` names a bad flag."""
    if args.kv_connector is None:
        for flag, value in (("--kv-connector-path", args.kv_connector_path), ("--kv-connector-bytes", args.kv_connector_bytes)):
            if value is not None:
                raise ValueError(f"{flag} needs --kv-connector host or disk")
        return None
    if not args.prefix_caching:
        raise ValueError("--kv-connector needs prefix caching (it stores prefixes by their prefix-cache hashes); "
                         "drop --no-prefix-caching")
    from ..engine.kv_connector import DiskStore, HostMemoryStore

    if args.kv_connector == "host":
        if args.kv_connector_path is not None:
            raise ValueError("--kv-connector-path is for --kv-connector disk")
        if args.kv_connector_bytes is None:
            raise ValueError("--kv-connector host needs --kv-connector-bytes (e.g. 16G of host memory)")
        return HostMemoryStore(args.kv_connector_bytes)
    if args.kv_connector_path is None:
        raise ValueError("--kv-connector disk needs --kv-connector-path DIR")
    try:
        return DiskStore(args.kv_connector_path, args.kv_connector_bytes)
    except OSError as err:  # e.g. the path is a file, or a parent is not writable
        raise ValueError(f"--kv-connector-path {args.kv_connector_path}: cannot use it as the connector's directory "
                         f"({err.strerror or err})") from None


# ``LLM`` keyword argument -> the argparse destination of its flag (``--`` + the destination with dashes): what
# ``engine_kwargs`` passes, and what ``with_flag_names`` writes as flags.
_ENGINE_FLAGS = {
    "dtype": "dtype", "tensor_parallel": "tensor_parallel", "max_num_seqs": "max_num_seqs",
    "max_model_len": "max_model_len", "max_num_batched_tokens": "max_num_batched_tokens", "max_chunk": "max_chunk",
    "max_prefill_rows": "max_prefill_rows", "decode_steps": "decode_steps", "chain_decode": "chain_decode",
    "chain_prefill": "chain_prefill", "page_size": "page_size", "cache_memory_fraction": "cache_memory_fraction",
    "enable_prefix_caching": "prefix_caching", "snapshot_memory_fraction": "snapshot_memory_fraction",
    "snapshot_interval": "snapshot_interval", "warm_up": "warm_up", "compilation_cache": "compilation_cache",
    "kv_connector": "kv_connector", "kv_load_timeout": "kv_load_timeout",
}


def with_flag_names(message: str) -> str:
    """``message`` (an engine settings error, ``CacheConfigError``, naming ``LLM`` keyword arguments, e.g.
    "max_chunk=4 exceeds max_num_batched_tokens=2") with each of ``engine_kwargs``' names written as its flag, for a
    command line's user. Only for those errors: others name a checkpoint's own fields (a tensor's dtype)."""
    message = message.replace("enable_prefix_caching=True", "--prefix-caching")
    message = message.replace("enable_prefix_caching=False", "--no-prefix-caching")
    for name, dest in _ENGINE_FLAGS.items():  # whole names only: not inside a longer identifier, a path or a flag
        message = re.sub(rf"(?<![\w./-]){re.escape(name)}(?![\w./])", "--" + dest.replace("_", "-"), message)
    return message


def engine_kwargs(args) -> dict:
    """``LLM`` keyword arguments of the model and engine flags (placement, tokenizer and seed excepted)."""
    kwargs = {name: getattr(args, dest) for name, dest in _ENGINE_FLAGS.items()}
    kwargs["kv_connector"] = kv_connector_store(args)  # the flags describe it; the engine takes the store
    return kwargs
