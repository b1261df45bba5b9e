#!/usr/bin/env python3
"""Each prefill kernel's GPU time (from a profiler trace) under several configurations, at the bench_prefill
shapes: the sweep behind the dispatch of ``pallas_kernels.delta_rule_prefill.prefill_slots``.

    python scripts/sweep_prefill.py [--case kda1 --case gdn8 ...] [--stage intra --stage state ...]

Stages: intra (KDA: prepare, products, exact, inverse, apply; GDN: one kernel), state (sequential state kernel),
state_output (the fused form, B=8 only), output (the chunk-parallel output kernel, B=1 only). A configuration
that does not compile (e.g. shared memory over the limit) is reported and skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from apriel2_jax.benchmarking import per_call_us, traced_kernel_times  # noqa: E402
from pallas_kernels import delta_rule_prefill as kernels  # noqa: E402
from scripts.bench_prefill import make_inputs  # noqa: E402
from scripts.profile_prefill import CASES  # noqa: E402

# keyword arguments of ``intra``: warp counts of its kernels
INTRA = {True: [{}, dict(inverse_warps=2), dict(products_warps=8), dict(num_warps=8)],
         False: [{}, dict(num_warps=8)]}
# (block_v, num_warps, num_stages)
STATE = [(16, 4, 4), (16, 4, 3), (32, 4, 2), (32, 4, 3), (32, 4, 4), (64, 4, 3), (64, 8, 3), (32, 8, 3)]
STATE_OUTPUT = [(128, 8, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (32, 4, 3)]
OUTPUT = [(128, 4, 2), (64, 4, 2), (128, 8, 2), (32, 4, 2)]


def measure(label: str, fn) -> None:
    start = time.time()
    try:
        jax.block_until_ready(fn())
        times = traced_kernel_times(lambda: jax.block_until_ready(fn()), 3, match="delta_rule")
    except Exception as e:  # noqa: BLE001 - a configuration the GPU cannot run is a result, not a stop
        print(f"{label}  failed: {str(e).splitlines()[0][:200]}", flush=True)
        return
    parts = ", ".join(f"{name.replace('delta_rule_', '')} {us:.0f}" for name, (_, us) in times.items())
    total = per_call_us(times, 3)
    print(f"{label}  {total:7.0f} us  ({parts}; {time.time() - start:.0f} s)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    ap.add_argument("--stage", action="append", choices=("intra", "state", "state_output", "output"))
    args = ap.parse_args(argv)
    stages = args.stage or ["intra", "state", "state_output", "output"]
    for case in args.case or ["kda1", "gdn1", "gdn8"]:
        kda, batch, length, heads = CASES[case]
        x = make_inputs(0, kda, batch, length, heads, 128)
        pool = jnp.asarray(np.random.default_rng(9).standard_normal((batch + 1, heads, 128, 128)) * 0.1, jnp.float32)
        tokens = x["q"].shape[0]
        chunks = tokens // kernels.CHUNK + x["starts"].shape[0]
        table = jax.jit(kernels.chunk_table, static_argnums=(2, 3))(x["starts"], x["lengths"], tokens, chunks)
        ops = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        zeros = jnp.zeros(x["v"].shape, x["v"].dtype)
        print(f"[{case}] kernel GPU time per call", flush=True)
        if "intra" in stages:
            for config in INTRA[kda]:
                fn = jax.jit(lambda *a, c=config: kernels.intra(table, *a, chunks, **c))
                label = " ".join(f"{key}={value}" for key, value in config.items())
                measure(f"{case} intra {label}", lambda fn=fn: fn(*ops))
        w, u, qk, qg, kd, glast = jax.jit(lambda *a: kernels.intra(table, *a, chunks))(*ops)
        if "state" in stages:
            for bv, warps, num_stages in STATE:
                fn = jax.jit(lambda *a, b=bv, nw=warps, n=num_stages: kernels.state(
                    table[3], table[4], x["slots"], x["fresh"], *a, block_v=b, num_warps=nw, num_stages=n))
                measure(f"{case} state block_v={bv} warps={warps} stages={num_stages}",
                        lambda fn=fn: fn(w, u, kd, glast, pool))
        if "state_output" in stages and batch > 1:
            for bv, warps, num_stages in STATE_OUTPUT:
                fn = jax.jit(lambda *a, b=bv, nw=warps, n=num_stages: kernels.state_output(
                    table, x["slots"], x["fresh"], *a, zeros, block_v=b, num_warps=nw, num_stages=n))
                measure(f"{case} state_output block_v={bv} warps={warps} stages={num_stages}",
                        lambda fn=fn: fn(w, u, kd, glast, qg, qk, pool))
        if "output" in stages and batch == 1:
            h, v_new, _ = jax.jit(lambda *a: kernels.state(table[3], table[4], x["slots"], x["fresh"], *a))(
                w, u, kd, glast, pool)
            for bv, warps, num_stages in OUTPUT:
                fn = jax.jit(lambda *a, b=bv, nw=warps, n=num_stages: kernels.output(
                    table, *a, zeros, block_v=b, num_warps=nw, num_stages=n))
                measure(f"{case} output block_v={bv} warps={warps} stages={num_stages}",
                        lambda fn=fn: fn(qg, h, qk, v_new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
