#!/usr/bin/env python3
"""Run each prefill kernel once at a benchmark shape, for a profiler (Nsight Compute) to attach to:

    ncu --kernel-name regex:intra --launch-skip 1 --launch-count 1 --section LaunchStats --section Occupancy \
        --section SpeedOfLight python3 scripts/profile_prefill.py --case kda1
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from apriel2_jax.benchmarking import traced_kernel_times  # noqa: E402
from pallas_kernels import delta_rule_prefill as kernels  # noqa: E402
from scripts.bench_prefill import make_inputs, print_kernel_times  # noqa: E402

CASES = {"gdn1": (False, 1, 8192, 16), "gdn8": (False, 8, 2048, 32), "kda1": (True, 1, 8192, 16)}


def stage_runner(x, pool):
    """A call of the three prefill stages (intra as dispatched; state and output at their defaults) on inputs
    ``x`` of ``bench_prefill.make_inputs``, each stage waited for, the pool copied."""
    num_tokens = x["q"].shape[0]
    num_chunks = num_tokens // kernels.CHUNK + x["starts"].shape[0]
    table = jax.jit(kernels.chunk_table, static_argnums=(2, 3))(x["starts"], x["lengths"], num_tokens, num_chunks)
    intra = jax.jit(lambda *a: kernels.intra(table, *a, num_chunks))
    state = jax.jit(lambda *a: kernels.state(*a))
    output = jax.jit(lambda *a: kernels.output(table, *a))

    def run():
        w, u, qk, qg, kd, glast = jax.block_until_ready(intra(x["q"], x["k"], x["v"], x["g"], x["beta"]))
        h, v_new, _ = jax.block_until_ready(state(table[3], table[4], x["slots"], x["fresh"], w, u, kd, glast,
                                                  jnp.array(pool, copy=True)))
        jax.block_until_ready(output(qg, h, qk, v_new, jnp.zeros(x["v"].shape, x["v"].dtype)))

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=sorted(CASES), default="kda1")
    ap.add_argument("--runs", type=int, default=2, help="calls of each kernel (the first compiles)")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="record the calls after the first with jax.profiler into DIR and print each kernel's median "
                         "GPU time from the trace (a check of the benchmarks' timing, no Nsight needed)")
    args = ap.parse_args(argv)
    kda, batch, length, heads = CASES[args.case]
    x = make_inputs(0, kda, batch, length, heads, 128)
    pool = jnp.asarray(np.random.default_rng(9).standard_normal((batch + 1, heads, 128, 128)) * 0.1, jnp.float32)
    run = stage_runner(x, pool)
    run()
    if args.trace:
        print_kernel_times(traced_kernel_times(run, args.runs - 1, args.trace, match="delta_rule"), args.runs - 1)
    else:
        for _ in range(args.runs - 1):
            run()
    print("done", args.case)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
