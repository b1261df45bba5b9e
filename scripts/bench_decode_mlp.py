#!/usr/bin/env python3
"""The persistent decode MLP kernel (``pallas_kernels/decode_mlp``) against the paths the engine runs without it.

    python scripts/bench_decode_mlp.py [--rows 1 8 32 --layers 24 --hidden 896 --intermediate 4864] [--profile]
                                       [--same-weights] [--sections mlp qkv] [--gemv-max-weight-mib [OP=]MIB ...]
                                       [--json PATH]

First the kernel's and the dispatched path's outputs against the jnp oracle
(``ops.decode_fused.gated_mlp_residual``) at each row count (exit status 1 on a mismatch beyond one bf16 rounding
of the projection and one of the add). Then ``--layers`` MLPs of random bf16 weights chained (each layer's output
the next one's input, so every call waits on the one before; ``benchmarking.time_looped``), µs per layer, each
path twice in alternating order:

- **dispatched**: the ops the engine calls without the kernel, ``norm_gated_mlp`` then ``matmul_add``: the decode
  GEMV kernels where they take the rows, from 8 rows the gate/up kernel (``decode_gated_product``) then the down
  kernel (``decode_matmul_add``), XLA elsewhere;
- **xla**: the jnp chain, compiled by XLA alone;
- **kernel**: ``decode_mlp.gated_mlp_residual`` (padding to 8 rows and the residual add included); below its
  ``MIN_ROWS`` (one row) it runs the dispatched ops. Row counts it has no schedule for (its SMEM budget at wide
  geometries) leave it out.

``--gemv-max-weight-mib`` sets the decode GEMV kernels' limit on one call's weights
(``decode_gemv.KERNEL_MAX_WEIGHT_BYTES``, per op) for the dispatched path: a large value runs the kernels at one
or two rows whatever the geometry, so **dispatched** against **xla** at ``--hidden`` / ``--intermediate`` says
where the limit belongs; ``norm_gated_mlp=100000 matmul_add=0`` forces the gate/up kernel alone (down in XLA),
and so on.

``--sections qkv`` chains ``--layers`` norm + Q/K/V projections (Q [hidden, hidden], K and V [hidden / 4, hidden],
each layer's Q columns added to its input as the next one's), the engine's op (**qkv dispatched**: the decode
GEMV kernel at one or two rows under the limit) against the jnp chain (**qkv xla**).

``--same-weights`` chains the first layer's weights ``--layers`` times instead (26 MB at the 0.5B geometry, which
can stay in a Hopper GPU's 50 MB L2; the hit rate is not measured): against the default, how much a path gains
when its weights were just read. Its TB/s and % columns still divide the weights' bytes by the time.

TB/s is the weights' bytes over the time (the activations are a few KB). ``--profile`` adds, per row count, the
kernel's per-CTA phases from Mosaic GPU's profiler (µs from the first CTA's first event; the profiler's own
overhead included), one call after warm-up.

Needs a GPU (Mosaic GPU kernels do not run on the CPU).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402,F401  (registers the GPU kernels)
from apriel2_jax import dispatch  # noqa: E402
from apriel2_jax.benchmarking import hbm_bandwidth, print_rows, time_looped  # noqa: E402
from apriel2_jax.ops import decode_fused  # noqa: E402
from pallas_kernels import decode_gemv, decode_mlp  # noqa: E402

F32 = jnp.float32
EPS = 1e-5


def mlp_weights(seed: int, hidden: int, inter: int):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    bf = jnp.bfloat16
    norm = (1 + 0.1 * jax.random.normal(k[0], (hidden,))).astype(bf)
    gate, up = [(0.03 * jax.random.normal(kk, (inter, hidden))).astype(bf) for kk in k[1:3]]
    down = (0.03 * jax.random.normal(k[3], (hidden, inter))).astype(bf)
    return norm, gate, up, down


def qkv_weights(seed: int, hidden: int):
    """Norm, Q [hidden, hidden], K and V [hidden / 4, hidden]: grouped-query attention with 4 heads per group."""
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    bf = jnp.bfloat16
    norm = (1 + 0.1 * jax.random.normal(k[0], (hidden,))).astype(bf)
    return (norm,) + tuple((0.03 * jax.random.normal(kk, (n, hidden))).astype(bf)
                           for kk, n in zip(k[1:], (hidden, hidden // 4, hidden // 4)))


def dispatched_qkv(x, norm, *weights):
    """The engine's op, chained through the Q columns (added to x: a small XLA fusion in both paths)."""
    return x + dispatch.op("norm_projections")(x, norm, EPS, weights)[:, : x.shape[1]]


def xla_qkv(x, norm, *weights):
    return x + decode_fused.norm_projections(x, norm, EPS, weights)[:, : x.shape[1]]


def dispatched(x, norm, gate, up, down):
    product = dispatch.op("norm_gated_mlp")(x, norm, EPS, gate, up, "silu")
    return dispatch.op("matmul_add")(product, down, x)


def xla(x, norm, gate, up, down):
    return decode_fused.gated_mlp_residual(x, norm, EPS, gate, up, down, "silu")


_kernel = dispatch.lowered_once(decode_mlp.gated_mlp_residual)  # lowered once, as the dispatch point would


def kernel(x, norm, gate, up, down):
    return _kernel(x, norm, EPS, gate, up, down, "silu")


def check(rows: int, weights, hidden: int, with_kernel: bool = True) -> list[dict]:
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, hidden)).astype(jnp.bfloat16)
    want = jax.jit(xla)(x, *weights).astype(F32)
    out = []
    for name, path in (("kernel", kernel), ("dispatched", dispatched))[0 if with_kernel else 1:]:
        got = jax.jit(path)(x, *weights).astype(F32)
        err, scale = float(jnp.max(jnp.abs(got - want))), float(jnp.max(jnp.abs(want)))
        out.append(dict(rows=rows, path=name, max_abs_err=round(err, 4), tolerance=round(2 ** -6 * scale, 4),
                        ok=err <= 2 ** -6 * scale))
    return out


def phases(rows: int, weights, hidden: int) -> list[dict]:
    """Per-phase begin and end (median and last CTA) of one profiled call."""
    plan = decode_mlp.schedule(rows, hidden, weights[1].shape[0], jax.devices()[0].core_count)
    out_dir = tempfile.mkdtemp()
    fn = jax.jit(lambda h, *w: decode_mlp.gated_mlp_sum(h, *w, act="silu", plan=plan, profile_dir=out_dir))
    h = jnp.full((plan.rows, hidden), 0.1, jnp.bfloat16)
    for _ in range(5):
        out = fn(h, *weights[1:])
    jax.block_until_ready(out)
    events = json.load(open(sorted(glob.glob(os.path.join(out_dir, "*.json")))[-1]))["traceEvents"]
    t0 = min(e["ts"] for e in events)
    spans, open_at = {}, {}
    for e in events:
        key = (e["tid"], e["name"])
        if e["ph"] == "B":
            open_at[key] = e["ts"] - t0
        else:
            spans.setdefault(e["name"], []).append((open_at.pop(key), e["ts"] - t0))
    rows_out = []
    for name, s in spans.items():
        begin, end = np.array([b for b, _ in s]), np.array([e for _, e in s])
        rows_out.append(dict(rows=rows, phase=name, ctas=len(s), begin_median_us=round(float(np.median(begin)), 2),
                             end_median_us=round(float(np.median(end)), 2), end_last_us=round(float(end.max()), 2)))
    return rows_out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=896, help="default: the 0.5B geometry")
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--down-depth", type=int, default=None, help="the kernel's most down-projection stages "
                    f"(default {decode_mlp.DOWN_DEPTH}; the schedule gives the rest of the SMEM to gate/up stages)")
    ap.add_argument("--issue-step", type=int, default=None, help="the gate/up step before which the kernel issues "
                    "its first down loads (0: before the loop; default: after the last gate/up load)")
    ap.add_argument("--group-regs", type=int, default=None, help="accumulator registers per thread for one wgmma "
                    f"over several down blocks (default {decode_mlp.GROUP_REGS}; 8 or less: one block per wgmma)")
    ap.add_argument("--smem-kb", type=int, default=None, help="the kernel's SMEM budget per CTA in KiB (default "
                    f"{decode_mlp.SMEM_BYTES // 1024}; a Hopper CTA may use 227)")
    ap.add_argument("--profile", action="store_true", help="add the kernel's per-CTA phases (see above)")
    ap.add_argument("--same-weights", action="store_true", help="chain the first layer's weights --layers times "
                    "(26 MB at the 0.5B geometry: can stay in L2) instead of --layers distinct layers")
    ap.add_argument("--gemv-max-weight-mib", nargs="+", default=None, metavar="[OP=]MIB",
                    help="the decode GEMV kernels' limit on one call's weights for the dispatched path: MIB for every "
                    f"op or OP=MIB for one of {', '.join(decode_gemv.KERNEL_MAX_WEIGHT_BYTES)} (default: the "
                    "engine's, decode_gemv.KERNEL_MAX_WEIGHT_BYTES; see above)")
    ap.add_argument("--sections", nargs="+", choices=["mlp", "qkv"], default=["mlp"],
                    help="mlp: the MLP paths; qkv: norm + Q/K/V projections (see above)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench_decode_mlp needs a GPU: Mosaic GPU kernels have no CPU path.", file=sys.stderr)
        return 2
    hidden, inter = args.hidden, args.intermediate
    for entry in args.gemv_max_weight_mib or ():
        limits = decode_gemv.KERNEL_MAX_WEIGHT_BYTES
        op, _, mib = entry.rpartition("=")
        try:
            value = float(mib)
        except ValueError:
            value = -1.0
        if value < 0 or (op and op not in limits):
            raise SystemExit(f"--gemv-max-weight-mib {entry}: expected MIB >= 0 or OP=MIB with OP one of "
                             f"{', '.join(limits)}")
        for name in [op] if op else list(limits):
            limits[name] = dict.fromkeys(limits[name], value * 2**20)  # at every row count the op's kernel takes
    if args.down_depth is not None:
        if args.down_depth < 1:
            raise SystemExit(f"--down-depth {args.down_depth}: must be at least 1")
        decode_mlp.DOWN_DEPTH = args.down_depth
    if args.issue_step is not None:
        decode_mlp.DOWN_ISSUE_STEP = max(args.issue_step, 0)
    if args.group_regs is not None:
        decode_mlp.GROUP_REGS = args.group_regs
    if args.smem_kb is not None:
        if not 64 <= args.smem_kb <= 227:
            raise SystemExit(f"--smem-kb {args.smem_kb}: must be 64-227")
        decode_mlp.SMEM_BYTES = args.smem_kb * 1024
    device = jax.devices()[0].device_kind
    bandwidth = hbm_bandwidth()
    print(f"{device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows_out = []

    def chain(path):
        def step(weights, x):
            for w in weights:
                x = path(x, *w)
            return x
        return step

    def timed(label, path, layers, rows, mbytes, weights="distinct"):
        """µs per layer of ``layers`` chained through ``path``; a row of the table, printed as it comes."""
        # A fresh input per timing: time_looped donates its carry.
        x = 0.1 * jax.random.normal(jax.random.PRNGKey(rows), (rows, hidden)).astype(jnp.bfloat16)
        seconds, _ = time_looped(chain(path), [layers], x, steps=20, repeats=5)
        us = seconds / len(layers) * 1e6
        rows_out.append(dict(device=device, rows=rows, path=label, weights=weights, us_per_layer=round(us, 2),
                             tb_s=round(mbytes / us, 2), pct_copy_bw=round(100 * mbytes / us * 1e12 / bandwidth)))
        print(f"rows {rows} {label}: {us:.2f} µs per layer", flush=True)

    if "mlp" in args.sections:
        scheduled = {rows: decode_mlp.schedule(rows, hidden, inter, jax.devices()[0].core_count) is not None
                     for rows in args.rows}
        for rows in args.rows:
            if not scheduled[rows]:
                print(f"rows {rows}: the kernel has no schedule for [{hidden} -> {inter}] on this GPU; its path is "
                      "left out", flush=True)
        mbytes = 3 * hidden * inter * 2 / 1e6
        weights = "one layer's weights, chained" if args.same_weights else "distinct weights"
        print(f"{args.layers} layers of [{hidden} -> {inter}] ({mbytes:.1f} MB of weights each; {weights})",
              flush=True)
        layers = [mlp_weights(seed, hidden, inter) for seed in range(1 if args.same_weights else args.layers)]
        if args.same_weights:
            layers = layers * args.layers
        checks = [c for rows in args.rows for c in check(rows, layers[0], hidden, scheduled[rows])]
        print_rows(checks)
        if not all(c["ok"] for c in checks):
            return 1

        paths = (("dispatched", dispatched), ("kernel", kernel), ("xla", xla))
        for rows in args.rows:
            for name, path in paths + paths[:2]:
                if name == "kernel" and not scheduled[rows]:
                    continue
                timed(name, path, layers, rows, mbytes, "same" if args.same_weights else "distinct")
    if "qkv" in args.sections:
        qkv_layers = [qkv_weights(1000 + seed, hidden) for seed in range(args.layers)]
        qkv_mbytes = sum(w.size * 2 for w in qkv_layers[0][1:]) / 1e6
        print(f"{args.layers} norm + Q/K/V projections: [{hidden} -> {hidden} + 2 x {hidden // 4}] "
              f"({qkv_mbytes:.1f} MB of weights each)", flush=True)
        paths = (("dispatched", dispatched_qkv), ("xla", xla_qkv))
        for rows in args.rows:
            x = 0.1 * jax.random.normal(jax.random.PRNGKey(rows), (rows, hidden)).astype(jnp.bfloat16)
            want = jax.jit(xla_qkv)(x, *qkv_layers[0]).astype(F32)
            got = jax.jit(dispatched_qkv)(x, *qkv_layers[0]).astype(F32)
            err, scale = float(jnp.max(jnp.abs(got - want))), float(jnp.max(jnp.abs(want)))
            if err > 2 ** -6 * scale:
                print(f"rows {rows} qkv: dispatched differs from xla by {err:.4f} (tolerance "
                      f"{2 ** -6 * scale:.4f})", file=sys.stderr)
                return 1
            for name, path in paths + paths:
                timed(f"qkv {name}", path, qkv_layers, rows, qkv_mbytes)
    if args.profile and "mlp" in args.sections:
        profile_rows = [r for rows in args.rows if scheduled[rows] for r in phases(rows, layers[0][:4], hidden)]
        print_rows(profile_rows)
    print_rows(rows_out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
