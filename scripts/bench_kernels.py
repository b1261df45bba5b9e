#!/usr/bin/env python3
"""Kernel benchmark on the GPU: parity against the jnp reference and fla's Triton kernels, then timings.

    python scripts/bench_kernels.py [--batch 256 --heads 32 --dim 128]

Decode update (GDN and KDA): state pool [B+1, H, K, V] fp32 read and written in place by slot; bf16 q/k/v.
fla (``fused_recurrent_gated_delta_rule`` / ``fused_recurrent_kda``, T = 1, initial and final state) moves the
same bytes. Times are medians after warm-up (fla: CUDA events per call; ours: calls issued back to back and waited
for once, host dispatch overlapped); bytes per call = 2 * B * H * K * V * 4 (the state, read + write;
q/k/v/gates are < 1% and not counted). Prints one table; ``--json`` writes the rows.
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

from apriel2_jax.benchmarking import hbm_bandwidth, print_rows, time_looped, time_torch_cuda  # noqa: E402
from apriel2_jax.ops.delta_rule import delta_rule_decode_slots  # noqa: E402
from pallas_kernels.delta_rule_decode import DISPATCH_CONFIG, delta_rule_decode  # noqa: E402


def inputs(seed: int, kda: bool, batch: int, heads: int, key_heads: int, dim: int):
    rng = np.random.default_rng(seed)
    bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)  # noqa: E731
    g_shape = (batch, heads, dim) if kda else (batch, heads)
    return dict(
        q=bf(batch, key_heads, dim),
        k=bf(batch, key_heads, dim),
        v=bf(batch, heads, dim),
        g=-jnp.asarray(rng.uniform(0.0, 2.0, g_shape), jnp.float32),
        beta=jnp.asarray(rng.uniform(0.0, 1.0, (batch, heads)), jnp.float32),
        slots=jnp.asarray(rng.permutation(batch) + 1, jnp.int32),
        fresh=jnp.zeros((batch,), bool),
    )


def time_ours(x_sets, pool, iters, **kw):
    """Device time per call: ``iters`` calls issued back to back, waited for once (like fla's CUDA events)."""
    return time_looped(lambda x, p: delta_rule_decode(**x, state_pool=p, **kw)[1], x_sets, pool, iters)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--gdn-key-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from fla.ops.kda import fused_recurrent_kda

    device = jax.devices()[0].device_kind
    bandwidth = hbm_bandwidth()
    B, H, D = args.batch, args.heads, args.dim
    nbytes = 2 * B * H * D * D * 4
    rows = []
    for kda in (False, True):
        name = "kda_decode" if kda else "gdn_decode"
        key_heads = H if kda else args.gdn_key_heads
        x_sets = [inputs(s, kda, B, H, key_heads, D) for s in range(3)]
        pool = jnp.asarray(np.random.default_rng(9).standard_normal((B + 1, H, D, D)) * 0.1, jnp.float32)
        x = x_sets[0]
        # Parity: ours vs the jnp op, and vs fla, on the same inputs (the pool is donated, so copy it first).
        pool_ref_input = jnp.array(pool, copy=True)
        o_ref, pool_ref = jax.jit(delta_rule_decode_slots)(**x, state_pool=pool)
        o, new_pool = delta_rule_decode(**x, state_pool=jnp.array(pool, copy=True))
        err_ref = float(jnp.abs(o.astype(jnp.float32) - o_ref.astype(jnp.float32)).max() / jnp.abs(o_ref.astype(jnp.float32)).max())
        err_state = float(jnp.abs(new_pool - pool_ref).max() / jnp.abs(pool_ref).max())
        def t(a):
            return torch.tensor(np.asarray(a.astype(jnp.float32)), device="cuda")

        order = np.asarray(x["slots"])
        h0 = t(pool)[order].contiguous()
        q, k, v = (t(x[n]).to(torch.bfloat16)[:, None] for n in ("q", "k", "v"))
        g, beta = t(x["g"])[:, None], t(x["beta"])[:, None]

        def run_fla():
            # Keywords: the two fla functions order their optional arguments differently (GDN: g, gk, gv, beta).
            fn = fused_recurrent_kda if kda else fused_recurrent_gated_delta_rule
            return fn(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)

        o_fla, ht = run_fla()
        o_fla = np.asarray(o_fla[:, 0].float().cpu())
        err_fla = float(np.abs(np.asarray(o, np.float32) - o_fla).max() / np.abs(o_fla).max())
        err_fla_state = float(np.abs(np.asarray(new_pool)[order] - ht.cpu().numpy()).max() / np.abs(ht.cpu().numpy()).max())
        # Timings: fla with CUDA events; ours (the dispatch configuration) issued back to back. The configuration
        # sweep is scripts/sweep_decode.py.
        fla_s = time_torch_cuda(run_fla, args.iters, warmup=5)
        cfg = DISPATCH_CONFIG
        block_v, warps, hp, stages = (cfg[n] for n in ("block_v", "num_warps", "heads_per_program", "num_stages"))
        seconds, pool = time_ours(x_sets, pool, args.iters, **cfg)
        o_best, pool_best = delta_rule_decode(**x, state_pool=jnp.array(pool_ref_input, copy=True), **cfg)
        err_best = float(jnp.abs(pool_best - pool_ref).max() / jnp.abs(pool_ref).max())
        err_best_out = float(jnp.abs(o_best.astype(jnp.float32) - o_ref.astype(jnp.float32)).max()
                             / jnp.abs(o_ref.astype(jnp.float32)).max())
        rows.append(
            dict(
                kernel=name, device=device, date=time.strftime("%Y-%m-%d"), shape=f"B={B} H={H} K=V={D}",
                ours_ms=round(seconds * 1e3, 4), fla_ms=round(fla_s * 1e3, 4), speedup_vs_fla=round(fla_s / seconds, 3),
                ours_TBps=round(nbytes / seconds / 1e12, 3), fla_TBps=round(nbytes / fla_s / 1e12, 3),
                pct_hbm_ours=round(100 * nbytes / seconds / bandwidth, 1), pct_hbm_fla=round(100 * nbytes / fla_s / bandwidth, 1),
                hbm_TBps=round(bandwidth / 1e12, 3), block_v=block_v, num_warps=warps, heads_per_program=hp,
                num_stages=stages,
                rel_err_vs_jnp=f"{err_ref:.1e}", rel_err_state_vs_jnp=f"{err_state:.1e}",
                rel_err_vs_fla=f"{err_fla:.1e}", rel_err_state_vs_fla=f"{err_fla_state:.1e}",
                rel_err_dispatch_config_vs_jnp=f"{err_best_out:.1e} / {err_best:.1e}",
            )
        )
    print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
