#!/usr/bin/env python3
"""Paged prefill attention benchmark on the GPU: the Pallas kernel against cuDNN and the jnp reference.

    python scripts/bench_attention_prefill.py                      # default kernel config
    python scripts/bench_attention_prefill.py --sweep              # sweep block sizes / warps / stages first
    python scripts/bench_attention_prefill.py --config 128,64,8,3  # block_q,block_k,num_warps,num_stages
    python scripts/bench_attention_prefill.py --dry-run            # tiny shapes, interpret mode, CPU
    python scripts/bench_attention_prefill.py --engine-05b --sweep # the 0.5B engine's prefill shape only
    timeout 300 python scripts/bench_attention_prefill.py --mgpu   # also the experimental Mosaic GPU kernel

Cases (bf16, D = 128, page size 64):
  (a) contiguous causal, B = 2, T = 4096, heads 16/16 and 32/8 (query/KV): our kernel reads K/V from pages laid
      out contiguously (so the comparison costs it nothing but the table lookups) vs
      ``jax.nn.dot_product_attention(is_causal=True, implementation="cudnn")`` and the jnp reference (the paged
      op); parity against cuDNN. FLOPs = 2 * B * H * T * T * D (the causal half of 4 * B * H * T * T * D).
      Plus the 32/8 case with the engine's default page size 16 (Triton kernel only; several pages per key block).
  (b) ragged paged prefill, 32/8 heads: 8 rows of 512..4096 new tokens on top of 0..8192 cached tokens, pages
      shuffled, rows padded to T = 4096 as the engine does. Useful FLOPs only (each valid query times the keys
      it sees); parity against the reference on one KV group per row (the full reference would not fit).
  (c) sliding window 4096 over T = 16384 contiguous tokens, B = 1, 16/16 heads, vs cuDNN with
      ``local_window_size=(4095, 0)``; useful FLOPs = sum over queries of min(p + 1, 4096) keys.
Times are medians over samples of ``--inner`` back-to-back calls after a warm-up; the bf16 matmul peak is
measured (8192^3 ``jnp.dot``) and every TFLOP/s is also given as a share of it. ``--sweep`` times every
configuration on case (a) 32/8 and uses the fastest for the whole table. ``--mgpu`` adds the experimental Mosaic
GPU kernel (``--mgpu-config block_q,block_k,stages,ping_pong``; with ``--sweep`` stages and ping-pong are swept); run
it under ``timeout``: a barrier bug in a new configuration would hang rather than fail. Progress lines go to stderr; one table
to stdout at the end; ``--json PATH`` writes everything.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from apriel2_jax.ops.paged_attention import paged_attention as reference  # noqa: E402
from pallas_kernels.paged_attention_prefill import (  # noqa: E402
    launch_config,
    paged_attention_prefill,
    paged_attention_prefill_mgpu,
)

BF16 = jnp.bfloat16
SWEEP = [  # (block_q, block_k, num_warps, num_stages)
    (bq, bk, w, st)
    for bq, bk in ((64, 32), (64, 64), (64, 128), (128, 32), (128, 64), (128, 128))
    for w in (4, 8)
    for st in (2, 3, 4)
    if not (bq == 64 and w == 8 and bk < 128)
]
DRY_SWEEP = [(32, 32, 4, 2), (32, 64, 4, 3)]
MGPU_SWEEP = [(64, 64, st, pp) for pp in (1, 0) for st in (2, 3, 4, 5)]  # (block_q, block_k, stages, ping_pong)


def log(msg: str) -> None:
    print(f"[bench_attention_prefill {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timeit(fn, *args, samples: int, inner: int):
    """Median seconds per call: one compile/warm-up call, one more warm-up, then ``samples`` x ``inner`` calls."""
    out = jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times), out


def rel_err(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


def matmul_peak(n: int) -> float:
    """Measured bf16 matmul FLOP/s (fp32 accumulation): the ceiling TFLOP/s figures are compared to."""
    a = jax.random.normal(jax.random.key(0), (n, n), BF16)
    b = jax.random.normal(jax.random.key(1), (n, n), BF16)
    t, _ = timeit(jax.jit(jnp.dot), a, b, samples=10, inner=5)
    return 2 * n**3 / t


def contiguous_pages(k: jax.Array, page_size: int):
    """[B, T, G, D] -> pool [1 + B*T/page_size, page_size, G, D] (page 0 the sink) and tables [B, T/page_size]."""
    batch, length, groups, dim = k.shape
    per_row = length // page_size
    pages = k.reshape(batch * per_row, page_size, groups, dim)
    pool = jnp.concatenate([jnp.zeros((1, page_size, groups, dim), k.dtype), pages])
    table = 1 + jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
    return pool, table


def cudnn_or_stand_in(dry: bool, **kw):
    """cuDNN on the GPU; the XLA implementation in a dry run (CPU has no cuDNN)."""
    impl = "xla" if dry else "cudnn"
    return jax.jit(functools.partial(jax.nn.dot_product_attention, implementation=impl, **kw))


def kernel_fn(cfg, window, dry):
    bq, bk, w, st = cfg
    return jax.jit(functools.partial(paged_attention_prefill, window=window, block_q=bq, block_k=bk, num_warps=w,
                                     num_stages=st, interpret=dry))


def mgpu_kernel_fn(cfg, window, dry):
    """The Mosaic GPU kernel; in a dry run its interpretable formulation in GPU interpret mode (abstract H100)."""
    bq, bk, st, pp = cfg
    f = functools.partial(paged_attention_prefill_mgpu, window=window, block_q=bq, block_k=bk, stages=st,
                          ping_pong=bool(pp), interpretable=dry)
    if not dry:
        return jax.jit(f)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)

    def run(*a):
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)), \
                plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            return f(*a)

    return run


def ours(cfg, window, args):
    """(impl name, fn, config) for each of our kernels in this run."""
    out = [("pallas-triton", kernel_fn(cfg, window, args.dry_run), cfg)]
    if args.mgpu:
        out.append(("pallas-mosaic", mgpu_kernel_fn(args.mgpu_cfg, window, args.dry_run), args.mgpu_cfg))
    return out


def time_ours(name, impl, fn, call_args, args):
    """Time one of our kernels; a Mosaic GPU failure is reported, not fatal."""
    try:
        return timeit(fn, *call_args, samples=args.samples, inner=args.inner)
    except Exception as e:
        if impl == "pallas-triton":
            raise
        log(f"{name}: {impl} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return None, None


def row(case, impl, seconds, flops, peak, err=None, cfg=None):
    tf = flops / seconds / 1e12
    return dict(case=case, impl=impl, ms=seconds * 1e3, tflops=tf, pct_peak=100 * flops / seconds / peak,
                rel_err=err, config=cfg_dict(cfg, impl))


def cfg_dict(cfg, impl):
    if cfg is None:
        return None
    if impl == "pallas-mosaic":
        return dict(zip(("block_q", "block_k", "stages", "ping_pong"), cfg))
    return dict(zip(("block_q", "block_k", "num_warps", "num_stages"), cfg))


def case_contiguous(batch, length, heads, groups, dim, page_size, cfg, peak, args, with_baselines=True, mosaic=False):
    rng = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(rng[0], (batch, length, heads, dim), BF16)
    k = jax.random.normal(rng[1], (batch, length, groups, dim), BF16)
    v = jax.random.normal(rng[2], (batch, length, groups, dim), BF16)
    k_pool, table = contiguous_pages(k, page_size)
    v_pool, _ = contiguous_pages(v, page_size)
    first = jnp.zeros((batch,), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    flops = 2 * batch * heads * length * length * dim
    name = f"causal B={batch} T={length} H={heads}/{groups}" + ("" if page_size == 64 else f" ps={page_size}")
    if not with_baselines:  # a sweep point: one kernel, one config
        fn = mgpu_kernel_fn(cfg, None, args.dry_run) if mosaic else kernel_fn(cfg, None, args.dry_run)
        t, _ = timeit(fn, q, k_pool, v_pool, table, first, pos, samples=args.samples, inner=args.inner)
        return [row(name, "pallas-mosaic" if mosaic else "pallas-triton", t, flops, peak, cfg=cfg)]
    t, out = timeit(kernel_fn(cfg, None, args.dry_run), q, k_pool, v_pool, table, first, pos,
                    samples=args.samples, inner=args.inner)
    t_cudnn, out_cudnn = timeit(cudnn_or_stand_in(args.dry_run, is_causal=True), q, k, v,
                                samples=args.samples, inner=args.inner)
    log(f"{name}: pallas {t * 1e3:.3f} ms, cudnn {t_cudnn * 1e3:.3f} ms")
    t_ref, out_ref = timeit(jax.jit(reference), q, k_pool, v_pool, table, first, pos, samples=3, inner=1)
    rows = [row(name, "pallas-triton", t, flops, peak, rel_err(out, out_cudnn), cfg)]
    rows[0]["rel_err_vs_reference"] = rel_err(out, out_ref)
    for impl, fn, c in ours(cfg, None, args)[1:]:
        t_m, out_m = time_ours(name, impl, fn, (q, k_pool, v_pool, table, first, pos), args)
        if t_m is not None:
            log(f"{name}: {impl} {t_m * 1e3:.3f} ms")
            rows.append(row(name, impl, t_m, flops, peak, rel_err(out_m, out_cudnn), c))
            rows[-1]["rel_err_vs_reference"] = rel_err(out_m, out_ref)
    rows.append(row(name, "cudnn", t_cudnn, flops, peak))
    rows.append(row(name, "jnp reference", t_ref, flops, peak, rel_err(out_ref, out_cudnn)))
    return rows


def case_ragged(new, cached, length, heads, groups, dim, page_size, cfg, peak, args):
    rng = np.random.default_rng(0)
    rows_n = len(new)
    width = max(-(-(c + length) // page_size) for c in cached)
    needed = [-(-(c + n) // page_size) for c, n in zip(cached, new)]
    num_pages = 1 + sum(needed)
    ids = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((rows_n, width), np.int32)
    used = 0
    for s, m in enumerate(needed):
        table[s, :m] = ids[used:used + m]
        used += m
    keys = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(keys[0], (rows_n, length, heads, dim), BF16)
    k_pool = jax.random.normal(keys[1], (num_pages, page_size, groups, dim), BF16)
    v_pool = jax.random.normal(keys[2], (num_pages, page_size, groups, dim), BF16)
    table = jnp.asarray(table)
    first = jnp.zeros((rows_n,), jnp.int32)
    pos = jnp.asarray(np.stack([np.arange(c, c + length) for c in cached]), jnp.int32)
    # Useful work: valid query i of row s sees cached[s] + i + 1 keys.
    flops = sum(4 * heads * dim * (n * c + n * (n + 1) // 2) for c, n in zip(cached, new))
    name = f"ragged paged {rows_n} rows H={heads}/{groups}"
    rep = heads // groups
    refs = [  # one KV group per row: the reference's fp32 scores fit
        jax.jit(reference)(q[s:s + 1, :, :rep], k_pool[:, :, :1], v_pool[:, :, :1], table[s:s + 1], first[s:s + 1],
                           pos[s:s + 1])
        for s in range(rows_n)
    ]
    rows = []
    for impl, fn, c in ours(cfg, None, args):
        t, out = time_ours(name, impl, fn, (q, k_pool, v_pool, table, first, pos), args)
        if t is None:
            continue
        err = max(rel_err(out[s:s + 1, :new[s], :rep], refs[s][:, :new[s]]) for s in range(rows_n))
        log(f"{name}: {impl} {t * 1e3:.3f} ms, max rel err vs reference {err:.2e}")
        rows.append(row(name, impl, t, flops, peak, cfg=c))
        rows[-1]["rel_err_vs_reference"] = err
    return rows


def case_window(length, window, heads, groups, dim, page_size, cfg, peak, args):
    rng = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(rng[0], (1, length, heads, dim), BF16)
    k = jax.random.normal(rng[1], (1, length, groups, dim), BF16)
    v = jax.random.normal(rng[2], (1, length, groups, dim), BF16)
    k_pool, table = contiguous_pages(k, page_size)
    v_pool, _ = contiguous_pages(v, page_size)
    first = jnp.zeros((1,), jnp.int32)
    pos = jnp.arange(length, dtype=jnp.int32)[None]
    seen = np.minimum(np.arange(length) + 1, window).sum()
    flops = 4 * heads * dim * int(seen)
    name = f"window {window} T={length} H={heads}/{groups}"
    t_cudnn, out_cudnn = timeit(
        cudnn_or_stand_in(args.dry_run, is_causal=True, local_window_size=(window - 1, 0)), q, k, v,
        samples=args.samples, inner=args.inner)
    rows = []
    for impl, fn, c in ours(cfg, window, args):
        t, out = time_ours(name, impl, fn, (q, k_pool, v_pool, table, first, pos), args)
        if t is not None:
            log(f"{name}: {impl} {t * 1e3:.3f} ms, cudnn {t_cudnn * 1e3:.3f} ms")
            rows.append(row(name, impl, t, flops, peak, rel_err(out, out_cudnn), c))
    return rows + [row(name, "cudnn", t_cudnn, flops, peak)]


def sweep(shape, peak, args, mosaic=False):
    if mosaic:
        configs = MGPU_SWEEP[:2] if args.dry_run else MGPU_SWEEP
    else:
        configs = DRY_SWEEP if args.dry_run else SWEEP
    results = []
    for i, cfg in enumerate(configs, start=1):
        try:
            r = case_contiguous(*shape, cfg=cfg, peak=peak, args=args, with_baselines=False, mosaic=mosaic)[0]
            log(f"sweep {i}/{len(configs)} {cfg}: {r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s")
        except Exception as e:  # a config Triton cannot compile (e.g. out of shared memory) is skipped
            log(f"sweep {i}/{len(configs)} {cfg}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            impl = "pallas-mosaic" if mosaic else "pallas-triton"
            r = dict(impl=impl, config=cfg_dict(cfg, impl), ms=None, error=str(e)[:300])
        results.append(r)
    ok = [r for r in results if r.get("ms") is not None]
    if not ok:
        if mosaic:
            log("no Mosaic GPU configuration ran; keeping --mgpu-config")
            return args.mgpu_cfg, results
        raise SystemExit("no sweep configuration compiled")
    best = min(ok, key=lambda r: r["ms"])
    return tuple(best["config"].values()), results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None,
                    help="block_q,block_k,num_warps,num_stages (default: the dispatch entry's launch_config for a "
                         "long chunk at the case's head dim: 128,64,8,3; with --engine-05b 64,128,4,3)")
    ap.add_argument("--sweep", action="store_true", help="time every config on case (a) 32/8 and use the best")
    ap.add_argument("--mgpu", action="store_true", help="also time the experimental Mosaic GPU kernel")
    ap.add_argument("--mgpu-config", default="64,64,3,1",
                    help="block_q,block_k,stages,ping_pong (0/1) of the Mosaic GPU kernel")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes in interpret mode (CPU): checks the script")
    ap.add_argument("--engine-05b", action="store_true",
                    help="only case (a) (and --sweep) at the 0.5B engine's prefill step: 8 rows x 1024 fresh tokens, "
                         "14/2 heads, D=64, pages of 16")
    args = ap.parse_args(argv)
    start = time.monotonic()
    if args.config:
        cfg = tuple(int(x) for x in args.config.split(","))
    else:  # the dispatch entry's for a long chunk at the case's head dim
        cfg = tuple(launch_config(1024, 64 if args.engine_05b else 128).values())
    if len(cfg) != 4:
        raise SystemExit("--config takes block_q,block_k,num_warps,num_stages")
    args.mgpu_cfg = tuple(int(x) for x in args.mgpu_config.split(","))
    if len(args.mgpu_cfg) != 4:
        raise SystemExit("--mgpu-config takes block_q,block_k,stages,ping_pong")

    if args.dry_run:
        args.samples, args.inner = 2, 1
        dim, ps, length, win_len, window, peak_n = 64, 64, 128, 256, 96, 256
        new, cached, rag_len = [64, 100, 128], [0, 30, 130], 128
        heads_mha, heads_gqa = (4, 4), (8, 2)
        if not args.sweep:
            cfg = (32, 32, 4, 3)
    else:
        dim, ps, length, win_len, window, peak_n = 128, 64, 4096, 16384, 4096, 8192
        new, cached, rag_len = [512, 4096, 1024, 3000, 2048, 700, 3500, 1500], [0, 0, 8192, 1000, 4096, 7000, 300, 6000], 4096
        heads_mha, heads_gqa = (16, 16), (32, 8)

    device = jax.devices()[0].device_kind
    log(f"device {device}, backend {jax.default_backend()}; measuring the bf16 matmul peak ({peak_n}^3)")
    peak = matmul_peak(peak_n)
    log(f"matmul peak {peak / 1e12:.0f} TFLOP/s")

    sweep_rows = None
    gqa_shape = (2, length, *heads_gqa, dim, ps)
    if args.engine_05b:
        gqa_shape = (2, 128, 4, 2, 64, 16) if args.dry_run else (8, 1024, 14, 2, 64, 16)
    if args.sweep:
        cfg, sweep_rows = sweep(gqa_shape, peak, args)
        log(f"best config {cfg}")
        if args.mgpu:
            args.mgpu_cfg, mgpu_rows = sweep(gqa_shape, peak, args, mosaic=True)
            sweep_rows += mgpu_rows
            log(f"best Mosaic GPU config {args.mgpu_cfg}")

    rows = []
    if args.engine_05b:
        log(f"case (a) causal at the 0.5B engine's prefill shape {gqa_shape}")
        rows += case_contiguous(*gqa_shape, cfg, peak, args)
    else:
        for h, g in (heads_mha, heads_gqa):
            log(f"case (a) causal H={h}/{g}")
            rows += case_contiguous(2, length, h, g, dim, ps, cfg, peak, args)
        # The engine's default page size (16): key blocks then gather several pages (Triton only).
        log(f"case (a) causal H={heads_gqa[0]}/{heads_gqa[1]}, page size 16")
        rows += case_contiguous(2, length, *heads_gqa, dim, 16, cfg, peak, args, with_baselines=False)
        log("case (b) ragged paged")
        rows += case_ragged(new, cached, rag_len, *heads_gqa, dim, ps, cfg, peak, args)
        log("case (c) sliding window")
        rows += case_window(win_len, window, *heads_mha, dim, ps, cfg, peak, args)

    print(f"\ndevice: {device}; bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; Triton kernel config "
          f"block_q,block_k,num_warps,num_stages = {cfg}" + (f"; Mosaic GPU block_q,block_k,stages,ping_pong = "
                                                             f"{args.mgpu_cfg}" if args.mgpu else ""))
    if sweep_rows:
        print(f"\nsweep (case (a) {gqa_shape[2]}/{gqa_shape[3]}):")
        for r in sorted(sweep_rows, key=lambda r: r["ms"] if r.get("ms") else float("inf")):
            c = tuple(r["config"].values())
            print(f"  {r['impl']:<14} {c}: " + (f"{r['ms']:.3f} ms  {r['tflops']:.0f} TFLOP/s" if r.get("ms") else "failed"))
    print(f"\n{'case':<36} {'impl':<14} {'ms':>9} {'TFLOP/s':>8} {'% peak':>7} {'rel err':>9} {'vs ref':>9}")
    by_case = {}
    for r in rows:
        err = f"{r['rel_err']:.2e}" if r.get("rel_err") is not None else "-"
        vref = f"{r['rel_err_vs_reference']:.2e}" if r.get("rel_err_vs_reference") is not None else "-"
        print(f"{r['case']:<36} {r['impl']:<14} {r['ms']:>9.3f} {r['tflops']:>8.1f} {r['pct_peak']:>6.1f}% {err:>9} {vref:>9}")
        by_case.setdefault(r["case"], {})[r["impl"]] = r["ms"]
    print("\n(rel err: max |x - cuDNN| / max |cuDNN|; vs ref: against the jnp reference op)")
    for case, impls in by_case.items():
        for impl in ("pallas-triton", "pallas-mosaic"):
            if "cudnn" in impls and impl in impls:
                print(f"{case}: {impl} runs at {impls['cudnn'] / impls[impl]:.2f}x the speed of cuDNN")
    log(f"done in {time.monotonic() - start:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, matmul_peak_tflops=peak / 1e12, config=cfg, rows=rows, sweep=sweep_rows,
                           dry_run=args.dry_run), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
