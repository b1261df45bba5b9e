#!/usr/bin/env python3
"""How fast a decode step can stream its weights: one kernel per matrix against one kernel for all of them.

    python scripts/bench_weight_streaming.py [--n 9728 --k 896 --layers 24] [--config 64,128,8 ...] [--json PATH]

A decode step at small batch reads every weight once and does little arithmetic, so its floor is bytes over
bandwidth. Three ways to read ``--layers`` bf16 matrices of [N, K] (default: the 0.5B geometry's gate and up
projections side by side, 17.4 MB per layer), each call of the timed step waiting on the one before
(``benchmarking.time_looped``: median of 5 rounds of 20 calls):

- **per-matrix kernels**: one Mosaic GPU kernel per matrix, run one after another on the stream: one CTA per SM
  streams its share of row blocks [bn, bk] through a TMA pipeline of ``depth`` SMEM stages (``--config
  bn,bk,depth``) and reads one element of each block, so the loads are used.
- **one kernel**: the same kernel once over the matrices stacked: the bytes of all layers with a single start and
  tail.
- **decode GEMV**: ``pallas_kernels.decode_gemv.norm_gated_mlp_kernel`` (RMSNorm + gate/up + activation product,
  one row) once per layer: the engine's kernel on the same bytes, arithmetic included.

The gap between the first two is each kernel's fixed cost (launch, pipeline fill, tail), which a decode step
pays for every projection. Needs a GPU (Mosaic GPU kernels do not run on the CPU).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from apriel2_jax.benchmarking import hbm_bandwidth, print_rows, time_looped  # noqa: E402
from pallas_kernels.decode_gemv import norm_gated_mlp_kernel  # noqa: E402


def stream_rows(w: jax.Array, after: jax.Array, *, programs: int, bn: int, bk: int, depth: int) -> jax.Array:
    """Read all of ``w`` [N, K] through SMEM: CTA p takes row blocks p, p + programs, ... (clamped at the end, so a
    short last round re-reads the last block). Returns one float per CTA (a sum of one element per block).
    ``after`` is not read: an input that orders the kernel behind whatever computed it."""
    n, k = w.shape
    if n % bn or k % bk:
        raise ValueError(f"--config {bn},{bk},{depth}: the blocks must divide the matrix [{n}, {k}]")
    blocks, chunks = n // bn, k // bk
    rounds = -(-blocks // programs)

    def body(w_gmem, _, out_gmem):
        p = jax.lax.axis_index("p")

        def step(_, w_smem, carry):
            return carry + w_smem[0, 0].astype(jnp.float32)

        total = plgpu.emit_pipeline(
            step, grid=(rounds, chunks),
            in_specs=[plgpu.BlockSpec((bn, bk), lambda i, j: (jnp.minimum(p + i * programs, blocks - 1), j))],
            max_concurrent_steps=depth, init_carry=jnp.float32(0.0),
        )(w_gmem)
        out_gmem[p] = total

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((programs,), jnp.float32), grid=(programs,),
                        grid_names=("p",))(w, after)


def per_layer_us(step, weights, carry, layers: int) -> float:
    """µs per layer of ``carry = step(weights, carry)``, each call waiting on the one before (``time_looped``:
    median of 5 rounds of 20 calls)."""
    seconds, _ = time_looped(step, [weights], carry, steps=20, repeats=5)
    return seconds / layers * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2 * 4864, help="rows of each matrix (default: gate + up, 0.5B)")
    ap.add_argument("--k", type=int, default=896, help="columns (the input width)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--config", action="append", default=None, help="bn,bk,depth (repeatable; default 64,128,8 "
                    "and 32,128,8)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench_weight_streaming needs a GPU: Mosaic GPU kernels have no CPU path.", file=sys.stderr)
        return 2
    if args.n % 2:
        raise SystemExit(f"--n {args.n} must be even (the GEMV reads it as gate and up halves)")
    configs = [tuple(int(v) for v in c.split(",")) for c in (args.config or ["64,128,8", "32,128,8"])]
    programs = jax.devices()[0].core_count
    n, k, layers = args.n, args.k, args.layers
    mbytes = n * k * 2 / 1e6
    bandwidth = hbm_bandwidth()
    device = jax.devices()[0].device_kind
    print(f"{device}: {programs} SMs, copy bandwidth {bandwidth / 1e12:.2f} TB/s; {layers} x [{n}, {k}] bf16 "
          f"({mbytes:.1f} MB each)", flush=True)
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    mats = [(0.02 * jax.random.normal(key, (n, k))).astype(jnp.bfloat16) for key in keys]
    rows = []

    def record(way, config, us):
        tbs = mbytes / us  # MB per µs = TB/s
        rows.append(dict(device=device, way=way, config=config, layers=layers, mb_per_layer=round(mbytes, 1),
                         us_per_layer=round(us, 2), tb_s=round(tbs, 2),
                         pct_copy_bw=round(100 * tbs * 1e12 / bandwidth)))

    for bn, bk, depth in configs:
        read = functools.partial(stream_rows, programs=programs, bn=bn, bk=bk, depth=depth)

        def per_matrix(matrices, x, read=read):
            # One stream runs the kernels one after another; a data dependence between them would add an XLA op
            # per layer, so they all wait on the call's input and their outputs are summed at the end.
            return x + sum(read(w, x)[0] for w in matrices)

        def one_kernel(stacked, x, read=read):
            return x + read(stacked, x)[0]

        carry = lambda: jnp.zeros((1,), jnp.float32)  # noqa: E731  (time_looped donates it)
        record("per-matrix kernels", f"{bn},{bk},{depth}", per_layer_us(per_matrix, mats, carry(), layers))
        stacked = jnp.concatenate(mats, axis=0)
        record("one kernel", f"{bn},{bk},{depth}", per_layer_us(one_kernel, stacked, carry(), layers))
        del stacked

    half = n // 2
    norm_weight = jnp.ones((k,), jnp.bfloat16)
    gate_up = [(w[:half], w[half:]) for w in mats]  # split outside the timed step (a slice inside is a copy)

    def gemv_per_layer(halves, x):
        total = sum(norm_gated_mlp_kernel(x, norm_weight, 1e-5, gate, up, "silu")[0, 0] for gate, up in halves)
        return x + total * 0

    record("decode GEMV (norm + gate/up)", "defaults",
           per_layer_us(gemv_per_layer, gate_up, jnp.ones((1, k), jnp.bfloat16), layers))
    print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
