#!/usr/bin/env python3
"""GDN/KDA chunked prefill on the GPU: our Pallas kernels vs fla's Triton ``chunk_gated_delta_rule`` /
``chunk_kda`` side by side in one run, plus parity against the jnp reference.

    python scripts/bench_prefill.py [--case gdn1|gdn8|kda1] [--config ...] [--trace DIR] [--json PATH]
    python scripts/bench_prefill.py --dry-run        # tiny shapes, interpret mode, CPU

Shapes (issue 4): GDN (B=1, T=8192, H=16) and (B=8, T=2048, H=32); KDA (B=1, T=8192, H=16); K = V = 128, bf16
q/k/v, fp32 gates, initial state from the slot pool and final state written back (fla: initial_state +
output_final_state). Ours packs the B sequences into one token buffer. Times are medians over rotating input
sets after warm-up, both from ``--iters`` calls issued back to back and waited for once, each call ordered behind
the previous one (ratios use these); fla's CUDA-event time per call is printed too. TFLOP/s counts the useful work of the chunked form, 6KV + 2C(3K + 2V) per token and head
(pallas_landscape.md §4b, no inverse), against a measured bf16 matmul peak.
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
import numpy as np  # noqa: E402

from apriel2_jax.benchmarking import (  # noqa: E402
    after, per_call_us, print_rows, time_looped, time_torch_back_to_back, time_torch_cuda, traced_kernel_times)
from apriel2_jax.ops.delta_rule import delta_rule_varlen_slots  # noqa: E402
from pallas_kernels.delta_rule_prefill import CHUNK, delta_rule_prefill, prefill_slots  # noqa: E402


def make_inputs(seed, kda, batch, length, heads, dim, decay=1.0):
    rng = np.random.default_rng(seed)
    n = batch * length
    bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)  # noqa: E731
    g_shape = (n, heads, dim) if kda else (n, heads)
    return dict(
        q=bf(n, heads, dim), k=bf(n, heads, dim), v=bf(n, heads, dim),
        g=-jnp.asarray(rng.uniform(0.0, decay if kda else 0.5, g_shape), jnp.float32),
        beta=jnp.asarray(rng.uniform(0.0, 1.0, (n, heads)), jnp.bfloat16),
        starts=jnp.arange(batch, dtype=jnp.int32) * length,
        lengths=jnp.full((batch,), length, jnp.int32),
        slots=jnp.asarray(rng.permutation(batch) + 1, jnp.int32),
        fresh=jnp.zeros((batch,), bool),
    )


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / np.abs(b).max())


def matmul_peak() -> float:
    a = jnp.ones((8192, 8192), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * 8192**3 / statistics.median(times)


def prefill_fn(cfg: dict, max_len: int):
    """The prefill a configuration names: {} is the dispatch (``prefill_slots``), else ``delta_rule_prefill``."""
    if not cfg:
        return functools.partial(prefill_slots, max_len=max_len)
    return functools.partial(delta_rule_prefill, **cfg)


def time_ours(x_sets, pool, iters, fn):
    """Time per call: ``iters`` calls issued back to back, waited for once (as ``time_torch_back_to_back`` for fla).
    The output is carried with the pool: a result the loop dropped would let XLA remove the kernel making it."""
    out = jnp.zeros(x_sets[0]["v"].shape, x_sets[0]["v"].dtype)
    def step(x, c):  # ``after``: each call starts once the previous one has finished, as in fla's timing
        return fn(**dict(x, starts=after(x["starts"], c)), state_pool=c[1])

    seconds, (_, pool) = time_looped(step, x_sets, (out, pool), iters, repeats=3)
    return seconds, pool


def print_kernel_times(times: dict, calls: int = 3) -> float:
    """Prints each kernel's median GPU time from ``traced_kernel_times`` and returns the µs per call of all."""
    for name, (count, median_us) in times.items():
        print(f"  kernel {name[:90]}: {count / calls:g} per call, median {median_us:.1f} us", flush=True)
    total = per_call_us(times, calls)
    print(f"  kernels' GPU time per call: {total:.1f} us", flush=True)
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--case", action="append", choices=("gdn1", "gdn8", "kda1"),
                    help="run only these cases (default: all)")
    ap.add_argument("--config", action="append", default=None,
                    help="a configuration to time instead of the dispatch, 'bv_state,bv_out,warps_intra,warps_state,"
                         "warps_out[,fuse_output 0/1[,products_warps[,stages_state]]]' (repeatable; "
                         "scripts/sweep_prefill.py times each kernel under many)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes in interpret mode (CPU check)")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="also record 3 calls of fla and of each configuration with jax.profiler into DIR (CUPTI sees "
                         "torch's kernels too) and print every kernel's GPU time and their sum per call")
    ap.add_argument("--decay", type=float, default=1.0,
                    help="KDA: per-token log decays drawn from [0, DECAY] nats per channel (the gate's usual init, "
                         "exp(A_log) up to 16, gives up to 16 x softplus(0) = 11 at a zero gate input)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dry = args.dry_run
    cases = [("gdn", 1, 8192, 16), ("gdn", 8, 2048, 32), ("kda", 1, 8192, 16)]
    if args.case:
        cases = [c for c, name in zip(cases, ("gdn1", "gdn8", "kda1")) if name in args.case]
    dim = 128
    if dry:
        cases, dim, args.iters = [("gdn", 2, 80, 2), ("kda", 1, 70, 2)], 16, 1
    configs = [{}]  # the dispatch (prefill_slots)
    if args.config:
        configs = []
        for text in args.config:
            bv, bo, w1, w2, w3, *rest = (int(x) for x in text.split(","))
            fuse = bool(rest and rest[0])
            configs.append(dict(block_v=(bv, bo), num_warps=(w1, w2, w3),
                                num_stages=(1, rest[2] if len(rest) > 2 else 2 if fuse else 4, 2),
                                fuse_output=fuse, products_warps=rest[1] if len(rest) > 1 else 4))
    if dry:
        configs = [dict(interpret=True, block_v=(16, 16))]
    device = jax.devices()[0].device_kind
    peak = None if dry else matmul_peak()
    rows = []
    for kind, batch, length, heads in cases:
        kda = kind == "kda"
        print(f"[{kind} B={batch} T={length} H={heads}] inputs", flush=True)
        x_sets = [make_inputs(s, kda, batch, length, heads, dim, args.decay) for s in range(1 if dry else 3)]
        pool = jnp.asarray(np.random.default_rng(9).standard_normal((batch + 1, heads, dim, dim)) * 0.1, jnp.float32)
        x = x_sets[0]
        pool0 = jnp.array(pool, copy=True)  # parity input; ``pool`` itself evolves through the timed calls
        o_ref, pool_ref = jax.jit(delta_rule_varlen_slots, static_argnames="max_len")(
            **x, state_pool=pool, max_len=length)
        o, new_pool = prefill_fn(configs[0], length)(**x, state_pool=jnp.array(pool, copy=True))
        err = (rel(o, o_ref), rel(new_pool, pool_ref))
        print(f"  parity vs jnp: out {err[0]:.1e} state {err[1]:.1e}", flush=True)
        fla_s, err_fla, fla_kernel_us = None, None, None
        if not dry:
            import torch
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            from fla.ops.kda import chunk_kda

            t = lambda a: torch.tensor(np.asarray(a.astype(jnp.float32)), device="cuda")  # noqa: E731
            shape = (batch, length, heads)
            q, k, v = (t(x[n]).to(torch.bfloat16).reshape(*shape, dim) for n in ("q", "k", "v"))
            g = t(x["g"]).reshape(*shape, dim) if kda else t(x["g"]).reshape(shape)
            beta = t(x["beta"]).to(torch.bfloat16).reshape(shape)
            h0 = t(pool)[np.asarray(x["slots"])].contiguous()
            fn = chunk_kda if kda else chunk_gated_delta_rule

            def run_fla():
                return fn(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)

            o_fla, ht = run_fla()
            err_fla = (rel(o, o_fla.float().reshape(batch * length, heads, dim).cpu().numpy()),
                       rel(np.asarray(new_pool)[np.asarray(x["slots"])], ht.float().cpu().numpy()))
            print(f"  parity vs fla: out {err_fla[0]:.1e} state {err_fla[1]:.1e}", flush=True)
            fla_events_s = time_torch_cuda(run_fla, args.iters)
            fla_s = time_torch_back_to_back(run_fla, args.iters)
            print(f"  fla: {fla_s * 1e3:.3f} ms back to back, {fla_events_s * 1e3:.3f} ms by CUDA events per call",
                  flush=True)
            if args.trace:
                fla_kernel_us = print_kernel_times(traced_kernel_times(
                    lambda: (run_fla(), torch.cuda.synchronize()), 3, os.path.join(args.trace, f"fla_{kind}_{batch}")))
        best, kernel_us = None, {}
        for cfg in configs:
            seconds, pool = time_ours(x_sets, pool, args.iters, prefill_fn(cfg, length))
            print(f"  {cfg or 'dispatch'}: {seconds * 1e3:.3f} ms", flush=True)
            if args.trace:  # kernel GPU time of this configuration, free of host dispatch
                call = jax.jit(prefill_fn(cfg, length))
                jax.block_until_ready(call(**x, state_pool=pool0))
                times = traced_kernel_times(lambda: jax.block_until_ready(call(**x, state_pool=pool0)), 3,
                                            os.path.join(args.trace, f"ours_{kind}_{batch}_{len(rows)}"),
                                            match="delta_rule")
                kernel_us[id(cfg)] = print_kernel_times(times)
            if best is None or seconds < best[0]:
                best = (seconds, cfg)
        seconds, cfg = best
        if cfg is not configs[0]:  # the winner's parity too (configurations change the kernels' tiles)
            o_best, pool_best = prefill_fn(cfg, length)(**x, state_pool=jnp.array(pool0, copy=True))
            err = (rel(o_best, o_ref), rel(pool_best, pool_ref))
            print(f"  parity of the winner vs jnp: out {err[0]:.1e} state {err[1]:.1e}", flush=True)
        tokens = batch * length
        flops = tokens * heads * (6 * dim * dim + 2 * CHUNK * (3 * dim + 2 * dim))
        row = dict(kernel=f"{kind}_prefill", device=device, date=time.strftime("%Y-%m-%d"),
                   shape=f"B={batch} T={length} H={heads} K=V={dim}" + (f" decay<={args.decay:g}" if kda else ""),
                   ours_ms=round(seconds * 1e3, 3),
                   config=str({k: v for k, v in cfg.items() if k != "interpret"} or "dispatch"),
                   err_vs_jnp=f"{err[0]:.1e}/{err[1]:.1e}")
        if fla_s is not None:
            row.update(fla_ms=round(fla_s * 1e3, 3), fla_events_ms=round(fla_events_s * 1e3, 3),
                       speedup_vs_fla=round(fla_s / seconds, 3),
                       ours_TFLOPs=round(flops / seconds / 1e12, 1), pct_peak=round(100 * flops / seconds / peak, 1),
                       peak_TFLOPs=round(peak / 1e12, 1), err_vs_fla=f"{err_fla[0]:.1e}/{err_fla[1]:.1e}")
        if fla_kernel_us and kernel_us.get(id(cfg)):  # the strict comparison: GPU time of the kernels alone
            row.update(ours_kernels_us=round(kernel_us[id(cfg)], 1), fla_kernels_us=round(fla_kernel_us, 1),
                       kernel_speedup=round(fla_kernel_us / kernel_us[id(cfg)], 3))
        rows.append(row)
        print("  " + str(row), flush=True)
    print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
