#!/usr/bin/env python3
"""One decode layer's kernels at the 0.5B geometry, each called twice on random inputs, for Nsight Compute.

    ncu --clock-control none --set full -k regex:'gemv|attention|_body' -o REPORT \\
        python3 scripts/profile_decode_kernels.py --rows 1 32 [--kinds gemv attention mosaic]

(``bash scripts/gpu_bench.sh OUT ncu05b`` runs it so and prints each kernel's registers, occupancy, waves, DRAM
throughput and duration.) Kinds, at each ``--rows`` count where the engine runs them:
- ``gemv`` (one or two rows): ``pallas_kernels/decode_gemv``'s four kernels of an attention layer's projections,
  in the order norm + gate/up + product (one row only), down + residual, norm + Q/K/V, output projection +
  residual;
- ``attention`` (any rows): the decode attention layer (``rope_write_paged_attention_decode``: RoPE, the page
  write, paged attention; at one or two rows its split merge kernel too) over a context of ``--context`` tokens in
  pages of ``--page-size`` in a random page order, with the block table ``bench_generate.py`` gives (the prompt,
  128 new tokens and one page);
- ``mosaic`` (8 rows and more): the Mosaic GPU kernels, gate/up + product (``gated_product_body``), Q/K/V
  (``projections_body``) and down + residual (``matmul_add_body``); their norms and pads are XLA fusions.
Each kind's calls run twice (the first compiles); Nsight Compute flushes the caches before each profiled launch, so
both launches of a kernel measure the same work. ``--clock-control none`` leaves the GPU's clocks as the engine runs
them. Needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from apriel2_jax.benchmarking import engine_table_pages, paged_decode_inputs  # noqa: E402
from pallas_kernels import decode_gated_product, decode_gemv, decode_matmul_add, decode_projections  # noqa: E402
from pallas_kernels.paged_attention_decode import rope_write_paged_attention_decode  # noqa: E402

KINDS = ("gemv", "attention", "mosaic")


def attention_inputs(rows, heads, groups, dim, context, page_size, new_tokens=128, seed=0):
    """The attention layer's arguments with every row at position ``context`` and the block table
    ``bench_generate.py`` gives (the prompt, ``new_tokens`` and one page)."""
    width = engine_table_pages(context, new_tokens, page_size)
    x, qkv, ((k_pages, v_pages),) = paged_decode_inputs(rows, heads, groups, dim, context, page_size, width, seed=seed)
    return (qkv, None, None, x["cos"], x["sin"], x["slots"], k_pages, v_pages, x["table"], x["first"],
            x["positions"])


def random_bf16(key):
    """A function of a shape returning small random bf16 values, a fresh key each call."""
    counter = iter(range(1 << 30))

    def rand(*shape):
        return (0.03 * jax.random.normal(jax.random.fold_in(key, next(counter)), shape)).astype(jnp.bfloat16)

    return rand


def calls_for(kind, rows, args, rand):
    """The calls of one kind at ``rows`` rows (none where the engine runs other code there)."""
    hidden, inter = args.hidden, args.intermediate
    q_width, kv_width = args.heads * args.head_dim, args.groups * args.head_dim
    x, norm = rand(rows, hidden), (1 + rand(hidden)).astype(jnp.bfloat16)
    if kind == "gemv":
        if rows > max(decode_gemv.KERNEL_ROWS.values()):
            return []
        product, attention_out = rand(rows, inter), rand(rows, q_width)
        gate, up, down = rand(inter, hidden), rand(inter, hidden), rand(hidden, inter)
        qkv = (rand(q_width, hidden), rand(kv_width, hidden), rand(kv_width, hidden))
        o_proj = rand(hidden, q_width)
        calls = [
            ("norm_gated_mlp", (gate, up), lambda: decode_gemv.norm_gated_mlp_kernel(x, norm, 1e-5, gate, up, "silu")),
            ("matmul_add", (down,), lambda: decode_gemv.matmul_add_kernel(product, down, x)),
            ("norm_projections", qkv, lambda: decode_gemv.norm_projections_kernel(x, norm, 1e-5, qkv)),
            ("matmul_add", (o_proj,), lambda: decode_gemv.matmul_add_kernel(attention_out, o_proj, x)),
        ]
        # only where the engine runs them (``decode_gemv.takes``: gate/up at one row, the others at two, within
        # ``KERNEL_MAX_WEIGHT_BYTES`` by op and rows)
        return [call for op, weights, call in calls if decode_gemv.takes(op, None, rows, weights)]
    if kind == "attention":
        inputs = attention_inputs(rows, args.heads, args.groups, args.head_dim, args.context, args.page_size)
        fn = jax.jit(rope_write_paged_attention_decode)
        return [lambda: fn(*inputs)[0]]
    if rows < decode_gated_product.MIN_ROWS:
        return []
    product, gate, up, down = rand(rows, inter), rand(inter, hidden), rand(inter, hidden), rand(hidden, inter)
    qkv = (rand(q_width, hidden), rand(kv_width, hidden), rand(kv_width, hidden))
    mlp = jax.jit(lambda x, n, g, u: decode_gated_product.norm_gated_mlp(x, n, 1e-5, g, u, "silu"))
    proj = jax.jit(lambda x, n, ws: decode_projections.norm_projections(x, n, 1e-5, ws))
    add = jax.jit(decode_matmul_add.matmul_add)
    for name, module, planned in (("gate/up", decode_gated_product, decode_gated_product.plan_for(
            x, norm, gate, up, "silu")), ("Q/K/V", decode_projections, decode_projections.plan_for(x, norm, qkv)),
            ("down", decode_matmul_add, decode_matmul_add.plan_for(product, down, x))):
        if planned is None:
            print(f"note: {name} at {rows} rows is not {module.__name__}'s kernel (falls back)")
    return [lambda: mlp(x, norm, gate, up), lambda: proj(x, norm, qkv), lambda: add(product, down, x)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="decode rows, each in turn")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--groups", type=int, default=2, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024,
                    help="each row's position (the prompt's tokens); the block table also spans 128 new tokens and "
                         "a page, as bench_generate.py's")
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("profile_decode_kernels needs a GPU (run it under ncu there).", file=sys.stderr)
        return 2
    if any(r < 1 for r in args.rows):
        raise SystemExit(f"--rows {args.rows}: each must be at least 1")
    rand = random_bf16(jax.random.PRNGKey(0))

    for rows in args.rows:
        for kind in args.kinds:
            calls = calls_for(kind, rows, args, rand)
            for _ in range(2):
                for call in calls:
                    jax.block_until_ready(call())
            print(f"ran {kind} at {rows} rows: {len(calls)} calls, twice")
    return 0


if __name__ == "__main__":
    sys.exit(main())
