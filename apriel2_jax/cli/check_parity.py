"""``check_parity.py CASE_DIR [--placement NAME] [--dtype float32|bfloat16] [--tensor-parallel N]
[--coordinator-address HOST:PORT --num-processes P --process-id I | --distributed]``"""

from __future__ import annotations

import argparse
import os
import sys

from .engine_args import add_distributed_arguments, join_processes, positive_int


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="apriel2-check-parity",
        description="Check a goldens-format directory (HF checkpoint + golden.safetensors) against this model: "
        "full forward, prefill+decode, and greedy generation, for every placement.",
        epilog="Exit status: 0 when every check passes, 1 when one fails (a float32 logit error above 1e-3 or a "
        "differing greedy token; in bfloat16 only gross logit errors), 2 for errors in the command or its inputs.",
    )
    parser.add_argument("case_dir", metavar="CASE_DIR",
                        help="directory with config.json, model safetensors, golden.safetensors")
    parser.add_argument("--placement", default=None, metavar="NAME",
                        help="check only this named placement of placements.json (the goldens hold logits and "
                             "tokens per named placement, so a per-layer mixer list cannot be checked)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="weights/compute dtype (default float32, the goldens' own)")
    parser.add_argument("--tensor-parallel", type=positive_int, default=None, metavar="N",
                        help="run the tensor-parallel path over N devices (forward and engine greedy checks; 1 checks "
                        "that path on one device)")
    add_distributed_arguments(parser)
    args = parser.parse_args(argv)

    import jax

    try:  # several processes run this same command over one mesh; process 0 prints the table
        joined = join_processes(args)
        if joined and args.tensor_parallel is None:
            raise ValueError(f"{jax.process_count()} processes are joined: give --tensor-parallel to split the "
                             f"model over them (every device: {jax.device_count()})")
    except ValueError as err:
        print(f"apriel2-check-parity: error: {err}", file=sys.stderr)
        return 2
    from ..distributed import is_primary

    primary = not joined or is_primary()

    from ..config import ConfigError
    from ..parity import format_table, run_checks
    from ..placement import PlacementError
    from ..safetensors_io import CheckpointError

    if not os.path.isdir(args.case_dir):
        print(f"apriel2-check-parity: error: case directory {args.case_dir} does not exist", file=sys.stderr)
        return 2
    try:
        results = run_checks(args.case_dir, args.placement, args.dtype, tensor_parallel=args.tensor_parallel)
    except (ConfigError, CheckpointError, PlacementError, FileNotFoundError, ValueError) as err:
        print(f"apriel2-check-parity: error: {err}", file=sys.stderr)
        return 2
    failed = [r for r in results if not r.passed]
    if primary:
        processes = f", {jax.process_count()} processes" if jax.process_count() > 1 else ""
        print(f"{args.case_dir} ({args.dtype}, device {jax.devices()[0].platform}, tensor parallel "
              f"{args.tensor_parallel or 'none'}{processes})")
        print(format_table(results))
        if failed:
            print(f"{len(failed)} check(s) failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
