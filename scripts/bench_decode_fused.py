#!/usr/bin/env python3
"""Fused vs unfused GDN/KDA decode step on the GPU, side by side in one run.

    python scripts/bench_decode_fused.py [--batch 256 --heads 32 --dim 128] [--json PATH]
    python scripts/bench_decode_fused.py --dry-run       # tiny shapes, interpret mode, CPU

Unfused = what the engine runs without the fused kernel: the conv decode kernel over the slot pool, the gates in
XLA, then ``delta_rule_decode`` (``decode_slots``, the dispatch entry). Fused = ``delta_rule_decode_fused``. Both
read the same conv and state pools by slot. Parity of both against the composed jnp oracle first; then median
step times after warm-up over rotating inputs (``--iters`` steps issued back to back and waited for once: host
dispatch overlapped), and % of HBM bandwidth on the bytes of the state (read + write), which dominate. The fused kernel runs
each ``--config`` (block_v,num_warps,slab_fastest); the table shows the best.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from apriel2_jax.benchmarking import print_rows, time_looped  # noqa: E402
from apriel2_jax.ops.norms import activation  # noqa: E402
from apriel2_jax.ops.delta_rule import gdn_decode_fused_slots, gdn_gate, kda_decode_fused_slots, kda_gate  # noqa: E402
from pallas_kernels import causal_conv1d, delta_rule_decode  # noqa: E402
from pallas_kernels.delta_rule_decode_fused import gdn_decode_fused, kda_decode_fused  # noqa: E402


def gdn_inputs(seed, batch, heads, key_heads, dim, taps, dtype):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    channels = 2 * key_heads * dim + heads * dim
    return dict(qkv=f(batch, channels), a=f(batch, heads), b=f(batch, heads),
                slots=jnp.asarray(rng.permutation(batch) + 1, jnp.int32), fresh=jnp.zeros((batch,), bool))


def kda_inputs(seed, batch, heads, dim, dtype):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    size = heads * dim
    return dict(q=f(batch, size), k=f(batch, size), v=f(batch, size), g_raw=f(batch, heads, dim),
                beta=jnp.asarray(rng.uniform(0, 1, (batch, heads)), jnp.float32),
                slots=jnp.asarray(rng.permutation(batch) + 1, jnp.int32), fresh=jnp.zeros((batch,), bool))


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / np.abs(b).max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--gdn-key-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--config", action="append", default=None,
                    help="fused kernel block_v,num_warps,slab_fastest (0/1); repeatable")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    B, H, Hk, D, taps = args.batch, args.heads, args.gdn_key_heads, args.dim, 4
    configs = [tuple(int(v) for v in c.split(",")) for c in (args.config or ["64,4,1"])]
    configs = [dict(block_v=bv, num_warps=w, slab_fastest=bool(sf)) for bv, w, sf in configs]
    interp = {}
    if args.dry_run:
        B, H, Hk, D, args.iters, interp = 3, 4, 2, 16, 2, dict(interpret=True)
    dtype = jnp.bfloat16
    rng = np.random.default_rng(5)
    bandwidth = None
    if not args.dry_run:
        from apriel2_jax.benchmarking import hbm_bandwidth

        bandwidth = hbm_bandwidth()
    state_bytes = 2 * B * H * D * D * 4
    A_log = jnp.log(jnp.linspace(1.0, 16.0, H)).astype(jnp.float32)
    rows = []
    if interp:  # CPU check of the script: the jnp conv, the decode kernel in interpret mode
        from apriel2_jax.ops.conv import causal_conv1d_decode_slots as conv_decode

        delta_decode = functools.partial(delta_rule_decode.delta_rule_decode, interpret=True)
    else:
        conv_decode, delta_decode = causal_conv1d.decode_slots, delta_rule_decode.decode_slots

    # ---------------- GDN
    channels = 2 * Hk * D + H * D
    weight = jnp.asarray(rng.standard_normal((channels, taps)) * 0.5, dtype)
    dt_bias = jnp.asarray(rng.standard_normal(H), jnp.float32)
    conv_pool = jnp.asarray(rng.standard_normal((B + 1, taps - 1, channels)), dtype)
    state_pool = jnp.asarray(rng.standard_normal((B + 1, H, D, D)) * 0.1, jnp.float32)
    x_sets = [gdn_inputs(s, B, H, Hk, D, taps, dtype) for s in range(3)]

    @functools.partial(jax.jit, donate_argnums=(1,))
    def gdn_unfused(x, pools):
        conv, state = pools
        mixed, conv = conv_decode(x["qkv"], weight, None, conv, x["slots"], x["fresh"])
        size = Hk * D
        q, k = mixed[:, :size].reshape(B, Hk, D), mixed[:, size:2 * size].reshape(B, Hk, D)
        v = mixed[:, 2 * size:].reshape(B, H, D)
        g, beta = gdn_gate(x["a"], A_log, dt_bias), activation("sigmoid", x["b"])
        o, state = delta_decode(q, k, v, g, beta, state, x["slots"], x["fresh"])
        return o, (conv, state)

    def gdn_fused(cfg):
        @functools.partial(jax.jit, donate_argnums=(1,))
        def step(x, pools):
            conv, state = pools
            o, conv, state = gdn_decode_fused(x["qkv"], weight, conv, x["a"], x["b"], A_log, dt_bias, state,
                                              x["slots"], x["fresh"], key_heads=Hk, **interp, **cfg)
            return o, (conv, state)

        return step

    x = x_sets[0]
    o_ref, conv_ref, state_ref = gdn_decode_fused_slots(x["qkv"], weight, conv_pool, x["a"], x["b"], A_log, dt_bias,
                                                        state_pool, x["slots"], x["fresh"], key_heads=Hk)
    gdn_rows = {}
    for name, step in [("unfused", gdn_unfused)] + [(f"fused {c}", gdn_fused(c)) for c in configs]:
        o, (conv, state) = step(x, (jnp.array(conv_pool, copy=True), jnp.array(state_pool, copy=True)))
        err = (rel(o, o_ref), rel(state, state_ref), rel(conv, conv_ref))
        seconds = time_looped(lambda xs, c: step(xs, c)[1], x_sets, (conv, state), args.iters)[0]
        gdn_rows[name] = (seconds, err)
        print(f"gdn {name}: {seconds * 1e6:.1f} us, err out/state/conv {err[0]:.1e}/{err[1]:.1e}/{err[2]:.1e}",
              flush=True)

    # ---------------- KDA
    size = H * D
    weights = tuple(jnp.asarray(rng.standard_normal((size, taps)) * 0.5, dtype) for _ in range(3))
    kda_bias = jnp.asarray(rng.standard_normal(size), jnp.float32)
    conv_pools = tuple(jnp.asarray(rng.standard_normal((B + 1, taps - 1, size)), dtype) for _ in range(3))
    k_sets = [kda_inputs(s, B, H, D, dtype) for s in range(3)]

    @functools.partial(jax.jit, donate_argnums=(1,))
    def kda_unfused(x, pools):
        convs, state = pools
        mixed, new = [], []
        for name, w, c in zip("qkv", weights, convs):
            y, c = conv_decode(x[name], w, None, c, x["slots"], x["fresh"])
            mixed.append(y.reshape(B, H, D))
            new.append(c)
        g = kda_gate(x["g_raw"], A_log, kda_bias)
        o, state = delta_decode(*mixed, g, x["beta"], state, x["slots"], x["fresh"])
        return o, (tuple(new), state)

    def kda_fused(cfg):
        @functools.partial(jax.jit, donate_argnums=(1,))
        def step(x, pools):
            convs, state = pools
            o, convs, state = kda_decode_fused(x["q"], x["k"], x["v"], weights, convs, x["g_raw"], x["beta"], A_log,
                                               kda_bias, state, x["slots"], x["fresh"], **interp, **cfg)
            return o, (convs, state)

        return step

    x = k_sets[0]
    o_ref, convs_ref, state_ref = kda_decode_fused_slots(x["q"], x["k"], x["v"], weights, conv_pools, x["g_raw"],
                                                         x["beta"], A_log, kda_bias, state_pool, x["slots"], x["fresh"])
    kda_rows = {}
    for name, step in [("unfused", kda_unfused)] + [(f"fused {c}", kda_fused(c)) for c in configs]:
        fresh_pools = (tuple(jnp.array(c, copy=True) for c in conv_pools), jnp.array(state_pool, copy=True))
        o, (convs, state) = step(x, fresh_pools)
        err = (rel(o, o_ref), rel(state, state_ref), max(rel(c, r) for c, r in zip(convs, convs_ref)))
        seconds = time_looped(lambda xs, c: step(xs, c)[1], k_sets, (convs, state), args.iters)[0]
        kda_rows[name] = (seconds, err)
        print(f"kda {name}: {seconds * 1e6:.1f} us, err out/state/conv {err[0]:.1e}/{err[1]:.1e}/{err[2]:.1e}",
              flush=True)

    for kind, result in (("gdn", gdn_rows), ("kda", kda_rows)):
        best = min((k for k in result if k != "unfused"), key=lambda k: result[k][0])
        fused = result[best]
        row = dict(kernel=f"{kind}_decode_fused", device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d"),
                   shape=f"B={B} H={H} K=V={D} taps={taps}", config=best.removeprefix("fused "),
                   unfused_us=round(result["unfused"][0] * 1e6, 1), fused_us=round(fused[0] * 1e6, 1),
                   speedup=round(result["unfused"][0] / fused[0], 3),
                   err_fused=f"{fused[1][0]:.1e}/{fused[1][1]:.1e}/{fused[1][2]:.1e}")
        if bandwidth:
            row.update(pct_hbm_fused=round(100 * state_bytes / fused[0] / bandwidth, 1),
                       pct_hbm_unfused=round(100 * state_bytes / result["unfused"][0] / bandwidth, 1))
        rows.append(row)
    print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
