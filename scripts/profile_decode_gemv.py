#!/usr/bin/env python3
"""The decode GEMV kernels (``pallas_kernels/decode_gemv``) of one layer, each called twice, for Nsight Compute.

    ncu --clock-control none -k regex:gemv --launch-skip 4 --launch-count 4 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python3 scripts/profile_decode_gemv.py [--rows 1 --hidden 896 --intermediate 4864 --q-width 896 --kv-width 128]

(``bash scripts/gpu_bench.sh OUT ncu05b`` runs it so and prints each kernel's registers, occupancy, waves, DRAM
throughput and duration.) The four kernels of an attention layer's projections at the given geometry (default:
the 0.5B's), in the order norm + gate/up + product, down + residual, norm + Q/K/V, output projection + residual,
on random bf16 weights: the first call of each compiles, the second is the one to profile (``--launch-skip 4``).
``--clock-control none`` leaves the GPU's clocks as the engine runs them. Needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import decode_gemv  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1, help=f"decode rows (1-{decode_gemv.MAX_ROWS})")
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--q-width", type=int, default=896, help="the query projection's output features")
    ap.add_argument("--kv-width", type=int, default=128, help="each of the key and value projections' features")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("profile_decode_gemv needs a GPU (run it under ncu there).", file=sys.stderr)
        return 2
    if not 1 <= args.rows <= decode_gemv.MAX_ROWS:
        raise SystemExit(f"--rows {args.rows}: the GEMV kernels take 1-{decode_gemv.MAX_ROWS} rows")
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))

    def rand(*shape):
        return (0.03 * jax.random.normal(next(keys), shape)).astype(jnp.bfloat16)

    rows, hidden, inter = args.rows, args.hidden, args.intermediate
    x, product, norm = rand(rows, hidden), rand(rows, inter), (1 + rand(hidden)).astype(jnp.bfloat16)
    gate, up, down = rand(inter, hidden), rand(inter, hidden), rand(hidden, inter)
    qkv = (rand(args.q_width, hidden), rand(args.kv_width, hidden), rand(args.kv_width, hidden))
    o_proj = rand(hidden, args.q_width)
    attention_out = rand(rows, args.q_width)
    calls = (
        lambda: decode_gemv.norm_gated_mlp_kernel(x, norm, 1e-5, gate, up, "silu"),
        lambda: decode_gemv.matmul_add_kernel(product, down, x),
        lambda: decode_gemv.norm_projections_kernel(x, norm, 1e-5, qkv),
        lambda: decode_gemv.matmul_add_kernel(attention_out, o_proj, x),
    )
    for _ in range(2):
        for call in calls:
            jax.block_until_ready(call())
    print(f"ran the 4 GEMV kernels twice: rows {rows}, hidden {hidden}, intermediate {inter}, "
          f"Q {args.q_width}, K/V {args.kv_width}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
