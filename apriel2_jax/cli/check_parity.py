"""``check_parity.py CASE_DIR [--placement NAME] [--dtype float32|bfloat16] [--tensor-parallel N]``"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Check a goldens-format directory (HF checkpoint + golden.safetensors) against this model: "
        "full forward, prefill+decode, and greedy generation, for every placement."
    )
    parser.add_argument("case_dir", help="directory with config.json, model safetensors, golden.safetensors")
    parser.add_argument("--placement", default=None, help="check only this named placement of placements.json")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                        help="run the tensor-parallel path over N devices (forward and engine greedy checks; 1 checks "
                        "that path on one device)")
    args = parser.parse_args(argv)

    import jax

    if args.dtype == "float32":
        # On GPUs XLA would otherwise run fp32 matmuls in TF32, which is far outside the 1e-3 budget.
        jax.config.update("jax_default_matmul_precision", "highest")
    from ..config import ConfigError
    from ..parity import format_table, run_checks
    from ..placement import PlacementError
    from ..safetensors_io import CheckpointError

    try:
        results = run_checks(args.case_dir, args.placement, args.dtype, tensor_parallel=args.tensor_parallel)
    except (ConfigError, CheckpointError, PlacementError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.case_dir} ({args.dtype}, device {jax.devices()[0].platform}, tensor parallel {args.tensor_parallel or 'none'})")
    print(format_table(results))
    failed = [r for r in results if not r.passed]
    if failed:
        print(f"{len(failed)} check(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
