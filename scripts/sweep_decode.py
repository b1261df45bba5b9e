#!/usr/bin/env python3
"""Device time of the GDN/KDA decode update kernels over a configuration sweep, for choosing the dispatch default.

    python scripts/sweep_decode.py [--batch 256 --heads 32 --dim 128 --steps 20] [--json PATH]
    python scripts/sweep_decode.py --dry-run      # tiny shapes, interpret mode, CPU
    python scripts/sweep_decode.py --profile kda  # a few calls of the dispatch default, for Nsight Compute

Each configuration runs ``--steps`` decode steps issued back to back with the state pool donated from step to step
and waited for once (``benchmarking.time_looped``): device time, host dispatch overlapped. Inputs rotate over three
sets. % HBM counts the fp32 state read + write per step. Parity of every configuration against the jnp op first.
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

from apriel2_jax.benchmarking import print_rows, time_looped  # noqa: E402
from apriel2_jax.ops.delta_rule import delta_rule_decode_slots  # noqa: E402
from pallas_kernels.delta_rule_decode import decode_slots, delta_rule_decode  # noqa: E402
from scripts.bench_kernels import inputs  # noqa: E402


CONFIGS = (
    # block_v, num_warps, heads_per_program, num_stages, slab_fastest
    [(bv, w, 1, 1, sf) for bv in (8, 16, 32, 64, 128) for w in (1, 2, 4) for sf in (False, True)]
    + [(bv, w, hp, st, sf) for bv in (16, 32, 64) for w in (2, 4) for hp in (2, 4) for st in (2, 3)
       for sf in (False, True)]
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--gdn-key-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--profile", choices=("gdn", "kda"), default=None)
    ap.add_argument("--config", action="append", default=None,
                    help="block_v,num_warps,heads_per_program,num_stages,slab_fastest(0/1); repeatable, replaces the sweep")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    B, H, Hk, D = args.batch, args.heads, args.gdn_key_heads, args.dim
    configs, interp = CONFIGS, {}
    if args.config:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.config]
        configs = [(bv, w, hp, st, bool(sf)) for bv, w, hp, st, sf in configs]
    if args.dry_run:
        B, H, Hk, D, args.steps, args.repeats = 3, 4, 2, 16, 2, 1
        configs, interp = [(8, 1, 1, 1, True), (8, 2, 2, 2, False)], dict(interpret=True)
    pool = jnp.asarray(np.random.default_rng(9).standard_normal((B + 1, H, D, D)) * 0.1, jnp.float32)
    if args.profile:
        x = inputs(0, args.profile == "kda", B, H, H if args.profile == "kda" else Hk, D)
        for _ in range(3):
            o, pool = decode_slots(**x, state_pool=pool)
            jax.block_until_ready(pool)
        print("done", args.profile)
        return 0
    bandwidth = None
    if not args.dry_run:
        from apriel2_jax.benchmarking import hbm_bandwidth

        bandwidth = hbm_bandwidth()
    state_bytes = 2 * B * H * D * D * 4
    rows = []
    for kda in (False, True):
        x_sets = [inputs(s, kda, B, H, H if kda else Hk, D) for s in range(3)]
        pool0 = jnp.array(pool, copy=True)  # parity input; ``pool`` itself evolves through the timed steps
        o_ref, pool_ref = jax.jit(delta_rule_decode_slots)(**x_sets[0], state_pool=pool0)
        results = []
        for bv, w, hp, st, sf in configs:
            cfg = dict(block_v=bv, num_warps=w, heads_per_program=hp, num_stages=st, slab_fastest=sf, **interp)
            try:
                o, new = delta_rule_decode(**x_sets[0], state_pool=jnp.array(pool0, copy=True), **cfg)
                err = max(float(jnp.abs(new - pool_ref).max() / jnp.abs(pool_ref).max()),
                          float(jnp.abs(o.astype(jnp.float32) - o_ref.astype(jnp.float32)).max()
                                / jnp.abs(o_ref.astype(jnp.float32)).max()))

                def step(x, p, cfg=cfg):
                    return delta_rule_decode(**x, state_pool=p, **cfg)[1]

                seconds, pool = time_looped(step, x_sets, pool, args.steps, args.repeats)
            except Exception as e:  # a configuration Triton cannot compile is reported, not fatal
                print(f"{'kda' if kda else 'gdn'} {cfg}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            results.append((seconds, bv, w, hp, st, sf, err))
            print(f"{'kda' if kda else 'gdn'} bv={bv} w={w} hp={hp} st={st} slab_fastest={sf}: "
                  f"{seconds * 1e6:.1f} us/step err {err:.1e}", flush=True)
        results.sort()
        for seconds, bv, w, hp, st, sf, err in results[:4]:
            row = dict(kernel="kda_decode" if kda else "gdn_decode", device=jax.devices()[0].device_kind,
                       date=time.strftime("%Y-%m-%d"), shape=f"B={B} H={H} K=V={D}", us_per_step=round(seconds * 1e6, 1),
                       block_v=bv, warps=w, heads_per_program=hp, stages=st, slab_fastest=sf, rel_err=f"{err:.1e}")
            if bandwidth:
                row.update(TBps=round(state_bytes / seconds / 1e12, 3),
                           pct_hbm=round(100 * state_bytes / seconds / bandwidth, 1),
                           hbm_TBps=round(bandwidth / 1e12, 3))
            rows.append(row)
    print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
