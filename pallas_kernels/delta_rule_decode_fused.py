"""GDN/KDA decode in one Pallas kernel (Triton backend), from the pre-conv projections: short conv against the
conv state, SiLU, q/k L2 norm, gates, the delta-rule update of the fp32 state (in place in the slot pool) and the
output. Issue 4 asks for this fusion: the unfused step runs a conv kernel and the gate math as separate XLA ops
before ``delta_rule_decode``.

Grid and state traffic are those of ``delta_rule_decode`` (one program per row, group of value heads and V-slab).
Each program convolves the channels it reads: its key head's q and k channels (recomputed by every program of
the key head; the conv is a few FMAs per channel) and its own V-slab of v. The conv states are not updated in
place: other programs of the same row still read the rows a write would replace, so the new rows (the last Kc-1
inputs) go to small [B, Kc-1, C] outputs, scattered into the pools afterwards; q/k channels are written by the
program of the key head's first value head and first slab only.

The oracles are ``apriel2_jax.ops.delta_rule.gdn_decode_fused_slots`` and ``kda_decode_fused_slots``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from apriel2_jax.ops.norms import softplus

from .delta_rule_decode import launch_grid, program_ids, supported as _decode_supported, update_slab

F32 = jnp.float32


def _kernel(
    slots_ref, fresh_ref, xq_ref, xk_ref, xv_ref, wq_ref, wk_ref, wv_ref, pq_ref, pk_ref, pv_ref,
    gate_ref, beta_ref, alog_ref, dtb_ref, state_in_ref,
    o_ref, nq_ref, nk_ref, nv_ref, state_ref,
    *, rep, scale, bv, hp, taps, offsets, kda, slab_fastest,
):
    del state_in_ref  # aliased with state_ref: the pool is updated in place
    row, group, slab = program_ids(slab_fastest)
    slot = slots_ref[row]
    fresh = fresh_ref[row] != 0
    key_dim = state_ref.shape[2]
    value_dim = state_ref.shape[3]

    def conv(x_ref, w_ref, p_ref, channel):
        """SiLU conv of channels ``channel`` (a pl.ds into x's channels); rounded to x's dtype like the unfused
        path. Returns the output and the Kc-1 rows of the new state."""
        x = x_ref[row, channel].astype(F32)
        acc = w_ref[channel, taps - 1].astype(F32) * x
        rows = []
        for j in range(taps - 1):
            s = p_ref[slot, j, channel].astype(x_ref.dtype).astype(F32)  # rounded as the unfused conv does
            s = jnp.where(fresh, jnp.zeros_like(s), s)
            acc += w_ref[channel, j].astype(F32) * s
            rows.append(s)
        y = (acc * jax.nn.sigmoid(acc)).astype(x_ref.dtype).astype(F32)
        return y, rows[1:] + [x]

    def store_rows(n_ref, rows, channel):
        for j, r in enumerate(rows):
            n_ref[row, j, channel] = r.astype(n_ref.dtype)

    def one_head(i, carry):
        head = group * hp + i
        key_head = head // rep
        kcols = pl.ds(key_head * key_dim, key_dim)
        q, q_rows = conv(xq_ref, wq_ref, pq_ref, pl.ds(offsets[0] + key_head * key_dim, key_dim))
        k, k_rows = conv(xk_ref, wk_ref, pk_ref, pl.ds(offsets[1] + key_head * key_dim, key_dim))
        vcols = pl.ds(offsets[2] + head * value_dim + slab * bv, bv)
        v, v_rows = conv(xv_ref, wv_ref, pv_ref, vcols)
        owner = (head % rep == 0) & (slab == 0)

        @pl.when(owner)
        def _():
            store_rows(nq_ref, q_rows, kcols)
            store_rows(nk_ref, k_rows, kcols)

        store_rows(nv_ref, v_rows, pl.ds(head * value_dim + slab * bv, bv))
        rate = jnp.exp(alog_ref[head].astype(F32))
        if kda:
            g = -rate * softplus(gate_ref[row, head, :].astype(F32)
                                  + dtb_ref[pl.ds(head * key_dim, key_dim)].astype(F32))
            beta = beta_ref[row, head].astype(F32)
        else:
            g = -rate * softplus(gate_ref[row, head].astype(F32) + dtb_ref[head].astype(F32))
            b = beta_ref[row, head].astype(F32)
            beta = jax.nn.sigmoid(b).astype(beta_ref.dtype).astype(F32)  # fp32, rounded once to b's dtype (torch)
        decay = jnp.exp(g)  # scalar (GDN) or [K] (KDA)
        update_slab(state_ref, o_ref, slot, row, head, pl.ds(slab * bv, bv), fresh, q, k, v,
                    decay[:, None] if kda else decay, beta, scale)
        return carry

    jax.lax.fori_loop(0, hp, one_head, 0)


@functools.partial(
    jax.jit,
    static_argnames=("key_heads", "offsets", "kda", "block_v", "num_warps", "heads_per_program", "num_stages",
                     "slab_fastest", "interpret"),
    donate_argnames=("state_pool",),
)
def _fused(xq, xk, xv, wq, wk, wv, pq, pk, pv, gate, beta, A_log, dt_bias, state_pool, slots, fresh, *,
           key_heads, offsets, kda, block_v=64, num_warps=2, heads_per_program=1, num_stages=1, slab_fastest=True,
           interpret=False):
    batch = xq.shape[0]
    heads, key_dim, value_dim = state_pool.shape[1:]
    taps = wq.shape[1]
    block_v = min(block_v, value_dim)
    if heads % heads_per_program:
        raise ValueError(f"heads_per_program={heads_per_program} must divide the {heads} heads")
    kernel = functools.partial(
        _kernel, rep=heads // key_heads, scale=key_dim**-0.5, bv=block_v, hp=heads_per_program, taps=taps,
        offsets=offsets, kda=kda, slab_fastest=slab_fastest)
    sds = jax.ShapeDtypeStruct
    rows_dtype = pq.dtype
    return pl.pallas_call(
        kernel,
        name="delta_rule_decode_fused",
        grid=launch_grid(batch, heads // heads_per_program, value_dim // block_v, slab_fastest),
        out_shape=(
            sds((batch, heads, value_dim), xv.dtype),
            sds((batch, taps - 1, key_heads * key_dim), rows_dtype),
            sds((batch, taps - 1, key_heads * key_dim), rows_dtype),
            sds((batch, taps - 1, heads * value_dim), rows_dtype),
            sds(state_pool.shape, F32),
        ),
        input_output_aliases={15: 4},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(slots.astype(jnp.int32), fresh.astype(jnp.int32), xq, xk, xv, wq, wk, wv, pq, pk, pv, gate, beta, A_log,
      dt_bias, state_pool)


def supported(key_dim: int, value_dim: int, taps: int) -> bool:
    """Power-of-two K and V (Triton tiles), and a conv of 2..5 taps."""
    probe_q = jax.ShapeDtypeStruct((1, 1, key_dim), F32)
    probe_v = jax.ShapeDtypeStruct((1, 1, value_dim), F32)
    return _decode_supported(probe_q, probe_v, jax.ShapeDtypeStruct((1, 1, 1), F32)) and 2 <= taps <= 5


def gdn_decode_fused(qkv, conv_weight, conv_pool, a, b, A_log, dt_bias, state_pool, slots, fresh, *, key_heads,
                     interpret=False, **config):
    """Signature of ``ops.delta_rule.gdn_decode_fused_slots`` (plus kernel configuration); the jnp op for shapes
    the kernel cannot take."""
    heads, key_dim, value_dim = state_pool.shape[1:]
    if not supported(key_dim, value_dim, conv_weight.shape[1]):
        from apriel2_jax.ops.delta_rule import gdn_decode_fused_slots

        return gdn_decode_fused_slots(qkv, conv_weight, conv_pool, a, b, A_log, dt_bias, state_pool, slots, fresh,
                                      key_heads=key_heads)
    size = key_heads * key_dim
    o, nq, nk, nv, state_pool = _fused(
        qkv, qkv, qkv, conv_weight, conv_weight, conv_weight, conv_pool, conv_pool, conv_pool, a, b, A_log,
        dt_bias, state_pool, slots, fresh, key_heads=key_heads, offsets=(0, size, 2 * size), kda=False,
        interpret=interpret, **config)
    rows = jnp.concatenate([nq, nk, nv], axis=2)
    return o, conv_pool.at[slots].set(rows), state_pool


def kda_decode_fused(q, k, v, conv_weights, conv_pools, g_raw, beta, A_log, dt_bias, state_pool, slots, fresh, *,
                     interpret=False, **config):
    """Signature of ``ops.delta_rule.kda_decode_fused_slots`` (plus kernel configuration); the jnp op for shapes
    the kernel cannot take."""
    heads, key_dim, value_dim = state_pool.shape[1:]
    if not supported(key_dim, value_dim, conv_weights[0].shape[1]):
        from apriel2_jax.ops.delta_rule import kda_decode_fused_slots

        return kda_decode_fused_slots(q, k, v, conv_weights, conv_pools, g_raw, beta, A_log, dt_bias, state_pool,
                                      slots, fresh)
    o, nq, nk, nv, state_pool = _fused(
        q, k, v, *conv_weights, *conv_pools, g_raw, beta, A_log, dt_bias, state_pool, slots, fresh,
        key_heads=heads, offsets=(0, 0, 0), kda=True, interpret=interpret, **config)
    pools = tuple(p.at[slots].set(n) for p, n in zip(conv_pools, (nq, nk, nv)))
    return o, pools, state_pool
