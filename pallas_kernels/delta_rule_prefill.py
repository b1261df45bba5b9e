"""Chunked GDN/KDA prefill in Pallas (Triton backend) over a flat token buffer, with states read from and written
back to the state-slot pool in place.

The math is the WY form of ``apriel2_jax.ops.delta_rule`` (chunks of C = 64 tokens). Per chunk and head, with
cumulative log decay G (per token for GDN, per token and key channel for KDA):

    A   = strict_lower(beta_t * sum_c k_tc k_sc exp(G_tc - G_sc))      T = (I + A)^-1
    w   = T (beta * k * exp(G))        u = T (beta * v)                 (no state needed)
    v'  = u - w S0                     S_next = exp(G_last) S0 + (k * exp(G_last - G))^T v'
    o   = (q * exp(G)) S0 + (lower(sum_c q_tc k_sc exp(G_tc - G_sc))) v'

Three kernels, following the split that fla and FlashQLA found faster than one fused kernel:

1. ``_intra_kernel``, parallel over (chunk, head): A, its inverse, w, u, the masked q-k matrix, and the
   decayed q and k the other two kernels need. The inverse is the blockwise doubling ladder
   ``X <- X - X A_off X`` over block sizes 1, 2, ..., C/2 (MaxText PR #4348): it never forms powers of A, whose
   entries grow combinatorially, so it is stable where the Neumann series is not.
2. ``_state_kernel``, one program per (sequence, head, V-slab): the only sequential part. The fp32 state slab
   lives in registers across the sequence's chunks; it stores the state at each chunk start and v'.
3. ``_output_kernel``, parallel over (chunk, head, V-slab): o from the stored chunk-start states.

KDA's per-channel decay cannot be factored as (k e^G)(k e^-G)^T: e^-G overflows once the decay is strong
(Apriel2's KDA gate has no lower bound). Off-diagonal 16-token sub-blocks use a reference point at the row
sub-block's first token, so both factors are decays (<= 1); the 16 diagonal offsets are computed exactly, one
offset at a time over all four sub-blocks.

Packing: sequences are cut into chunks that start at the sequence start, gathered (XLA) into a chunk layout
[H, num_chunks, C, ...] with zeros past each sequence's end (zero k, beta and g: identity updates). The chunk table
bound num_chunks = N // C + S holds for any lengths summing to at most N.

Precision: float32 inputs run every product in IEEE fp32 (parity with the reference op); bf16 inputs use bf16
operands with fp32 accumulation for the state products and tf32 for the intra-chunk ones, as fla does.
The reference (and CPU path) is ``apriel2_jax.ops.delta_rule.delta_rule_varlen_slots``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
CHUNK = 64
SUB = 16


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(q: jax.Array, v: jax.Array) -> bool:
    """The Triton backend needs power-of-two tiles: K and V must be powers of two, at least 16 (dot sizes)."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    return _is_power_of_two(key_dim) and _is_power_of_two(value_dim) and key_dim >= 16 and value_dim >= 16


def _dot(a, b, precision, trans_a=False, trans_b=False):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


# ----------------------------------------------------------------------------------------------------------------
# 1. Intra-chunk: A, (I + A)^-1, w, u, masked q-k, decayed q and k


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, qk_ref, qg_ref, kd_ref, *, rep, kda, precision):
    chunk, head = pl.program_id(0), pl.program_id(1)
    key_head = head // rep
    q = q_ref[key_head, chunk, :, :].astype(F32)  # [C, K], normalised and scaled
    k = k_ref[key_head, chunk, :, :].astype(F32)
    v = v_ref[head, chunk, :, :].astype(F32)  # [C, V]
    beta = beta_ref[head, chunk, :].astype(F32)  # [C]
    size = q.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)

    if kda:
        G = g_ref[head, chunk, :, :]  # [C, K] cumulative log decay
        g_last = g_ref[head, chunk, size - 1, :]  # [K]
        kk = jnp.zeros((size, size), F32)
        qk = jnp.zeros((size, size), F32)
        t = jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
        # Off-diagonal sub-blocks: reference point r at the first token of the row sub-block; for rows t >= r and
        # columns s < r both exponents G_t - G_r and G_r - G_s are <= 0.
        for r in range(SUB, size, SUB):
            g_ref_row = g_ref[head, chunk, r, :]  # [K]
            in_rows = ((t >= r) & (t < r + SUB))[:, None]
            row_decay = jnp.exp(jnp.minimum(G - g_ref_row[None, :], 0.0))
            col_decay = jnp.where((t < r)[:, None], jnp.exp(jnp.minimum(g_ref_row[None, :] - G, 0.0)), 0.0)
            kb = k * col_decay
            kk += _dot(jnp.where(in_rows, k * row_decay, 0.0), kb, precision, trans_b=True)
            qk += _dot(jnp.where(in_rows, q * row_decay, 0.0), kb, precision, trans_b=True)
        # Diagonal sub-blocks, exactly: offset o pairs every row t with column s = SUB * (t // SUB) + o.
        for o in range(SUB):
            s = (t // SUB) * SUB + o
            k_s = k_ref[key_head, chunk, s, :].astype(F32)  # row gather [C, K]
            g_s = g_ref[head, chunk, s, :]
            kd_s = k_s * jnp.exp(jnp.minimum(G - g_s, 0.0))
            at_s = cols == s[:, None]
            kk += jnp.where(at_s & (t > s)[:, None], jnp.sum(k * kd_s, axis=1)[:, None], 0.0)
            qk += jnp.where(at_s & (t >= s)[:, None], jnp.sum(q * kd_s, axis=1)[:, None], 0.0)
        decay = jnp.exp(G)
        k_to_end = k * jnp.exp(g_last[None, :] - G)
    else:
        G = g_ref[head, chunk, :]  # [C]
        g_last = g_ref[head, chunk, size - 1]
        pair = jnp.exp(jnp.where(rows >= cols, G[:, None] - G[None, :], -jnp.inf))
        kk = jnp.where(rows > cols, _dot(k, k, precision, trans_b=True) * pair, 0.0)
        qk = _dot(q, k, precision, trans_b=True) * pair
        decay = jnp.exp(G)[:, None]
        k_to_end = k * jnp.exp(g_last - G)[:, None]

    a = kk * beta[:, None]
    # (I + A)^-1 by blockwise doubling: X holds the inverses of the diagonal blocks of size b; merging two
    # neighbours [[X1, 0], [A21, X2]] gives [[X1, 0], [-X2 A21 X1, X2]], i.e. X <- X - X A_off X.
    x = jnp.where(rows == cols, 1.0, 0.0) - jnp.where((rows // 2 == cols // 2) & (rows % 2 == 1) & (cols % 2 == 0), a, 0.0)
    b = 2
    while b < size:
        off = (rows // (2 * b) == cols // (2 * b)) & ((rows // b) % 2 == 1) & ((cols // b) % 2 == 0)
        x = x - _dot(_dot(x, jnp.where(off, a, 0.0), precision), x, precision)
        b *= 2
    out = w_ref.dtype
    w_ref[head, chunk, :, :] = _dot(x, k * decay * beta[:, None], precision).astype(out)
    u_ref[head, chunk, :, :] = _dot(x, v * beta[:, None], precision).astype(out)
    qk_ref[head, chunk, :, :] = qk.astype(out)
    qg_ref[head, chunk, :, :] = (q * decay).astype(out)
    kd_ref[head, chunk, :, :] = k_to_end.astype(out)


# ----------------------------------------------------------------------------------------------------------------
# 2. The recurrence over chunks


def _state_kernel(
    first_ref, count_ref, slots_ref, fresh_ref, w_ref, u_ref, kd_ref, glast_ref, pool_in_ref,
    h_ref, vnew_ref, pool_ref, *, bv, kda, precision,
):
    del pool_in_ref  # aliased with pool_ref: the pool is updated in place
    seq, head, slab = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(slab * bv, bv)
    slot = slots_ref[seq]
    state = pool_ref[slot, head, :, cols]  # [K, BV] fp32
    state = jnp.where(fresh_ref[seq] != 0, jnp.zeros_like(state), state)
    first = first_ref[seq]
    mm = w_ref.dtype

    def chunk_step(i, state):
        chunk = first + i
        h_ref[head, chunk, :, cols] = state.astype(h_ref.dtype)
        w = w_ref[head, chunk, :, :]
        v_new = u_ref[head, chunk, :, cols].astype(F32) - _dot(w, state.astype(mm), precision)
        vnew_ref[head, chunk, :, cols] = v_new.astype(vnew_ref.dtype)
        if kda:
            end_decay = jnp.exp(glast_ref[head, chunk, :])[:, None]  # [K, 1]
        else:
            end_decay = jnp.exp(glast_ref[head, chunk])
        return end_decay * state + _dot(kd_ref[head, chunk, :, :], v_new.astype(mm), precision, trans_a=True)

    state = jax.lax.fori_loop(0, count_ref[seq], chunk_step, state)
    pool_ref[slot, head, :, cols] = state


# ----------------------------------------------------------------------------------------------------------------
# 3. Output


def _output_kernel(qg_ref, h_ref, qk_ref, vnew_ref, o_ref, *, bv, precision):
    chunk, head, slab = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(slab * bv, bv)
    mm = qg_ref.dtype
    out = _dot(qg_ref[head, chunk, :, :], h_ref[head, chunk, :, cols].astype(mm), precision)
    out += _dot(qk_ref[head, chunk, :, :], vnew_ref[head, chunk, :, cols].astype(mm), precision)
    o_ref[head, chunk, :, cols] = out.astype(o_ref.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Packing and the entry point


def chunk_table(starts: jax.Array, lengths: jax.Array, num_chunks: int, size: int):
    """Chunks of every sequence, in sequence order: token index [num_chunks, size] (clipped), its validity, and
    per sequence its first chunk and chunk count."""
    count = (lengths + size - 1) // size
    ends = jnp.cumsum(count)
    first = ends - count
    i = jnp.arange(num_chunks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, i, side="right"), starts.shape[0] - 1)
    j = i - first[seq]
    chunk_len = jnp.where(i < ends[-1], jnp.clip(lengths[seq] - j * size, 0, size), 0)
    offset = jnp.arange(size, dtype=jnp.int32)
    index = starts[seq][:, None] + j[:, None] * size + offset[None, :]
    valid = offset[None, :] < chunk_len[:, None]
    return index, valid, first.astype(jnp.int32), count.astype(jnp.int32)


def _l2_normalize(x):
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


@functools.partial(
    jax.jit,
    static_argnames=("max_len", "block_v", "num_warps", "num_stages", "interpret"),
    donate_argnames=("state_pool",),
)
def delta_rule_prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state_pool: jax.Array,
    starts: jax.Array,
    lengths: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    *,
    max_len: int | None = None,
    block_v: int = 32,
    num_warps: tuple[int, int, int] = (4, 4, 4),
    num_stages: tuple[int, int, int] = (1, 2, 2),
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Signature of ``delta_rule_varlen_slots`` (``max_len`` is not needed here). ``num_warps``/``num_stages``
    are per kernel (intra, state, output); ``block_v`` is the V-slab of the state and output kernels."""
    del max_len
    num_tokens, heads, value_dim = v.shape
    key_heads, key_dim = q.shape[1:]
    if heads % key_heads:
        raise ValueError(f"value heads ({heads}) must be a multiple of key heads ({key_heads})")
    kda = g.ndim == 3
    size = CHUNK
    block_v = min(block_v, value_dim)
    num_seqs = starts.shape[0]
    num_chunks = num_tokens // size + num_seqs
    exact = v.dtype == F32
    precision = jax.lax.Precision.HIGHEST if exact else jax.lax.Precision.DEFAULT
    mm = F32 if exact else jnp.bfloat16

    index, valid, first, count = chunk_table(starts.astype(jnp.int32), lengths.astype(jnp.int32), num_chunks, size)

    def to_chunks(x, dtype):  # [N, h, ...] -> [h, num_chunks, C, ...], zeros past each sequence's end
        x = x[index]
        x = jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, jnp.zeros_like(x))
        return jnp.moveaxis(x, 2, 0).astype(dtype)

    qc = to_chunks(_l2_normalize(q) * key_dim**-0.5, mm)
    kc = to_chunks(_l2_normalize(k), mm)
    vc = to_chunks(v, mm)
    gc = jnp.cumsum(to_chunks(g.astype(F32), F32), axis=2)  # chunk-local cumulative log decay
    bc = to_chunks(beta.astype(F32), F32)
    glast = gc[:, :, size - 1]

    grid1 = (num_chunks, heads)
    sds = jax.ShapeDtypeStruct
    w, u, qk, qg, kd = pl.pallas_call(
        functools.partial(_intra_kernel, rep=heads // key_heads, kda=kda, precision=precision),
        grid=grid1,
        out_shape=(
            sds((heads, num_chunks, size, key_dim), mm),
            sds((heads, num_chunks, size, value_dim), mm),
            sds((heads, num_chunks, size, size), mm),
            sds((heads, num_chunks, size, key_dim), mm),
            sds((heads, num_chunks, size, key_dim), mm),
        ),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps[0], num_stages=num_stages[0]),
        interpret=interpret,
    )(qc, kc, vc, gc, bc)

    h, v_new, state_pool = pl.pallas_call(
        functools.partial(_state_kernel, bv=block_v, kda=kda, precision=precision),
        grid=(num_seqs, heads, value_dim // block_v),
        out_shape=(
            sds((heads, num_chunks, key_dim, value_dim), mm),
            sds((heads, num_chunks, size, value_dim), mm),
            sds(state_pool.shape, F32),
        ),
        input_output_aliases={8: 2},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps[1], num_stages=num_stages[1]),
        interpret=interpret,
    )(first, count, slots.astype(jnp.int32), fresh.astype(jnp.int32), w, u, kd, glast, state_pool)

    oc = pl.pallas_call(
        functools.partial(_output_kernel, bv=block_v, precision=precision),
        grid=(num_chunks, heads, value_dim // block_v),
        out_shape=sds((heads, num_chunks, size, value_dim), v.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps[2], num_stages=num_stages[2]),
        interpret=interpret,
    )(qg, h, qk, v_new)

    oc = jnp.moveaxis(oc, 0, 2).reshape(num_chunks * size, heads, value_dim)
    target = jnp.where(valid, index, num_tokens).reshape(-1)
    o = jnp.zeros(v.shape, v.dtype).at[target].set(oc, mode="drop")
    return o, state_pool


def prefill_slots(q, k, v, g, beta, state_pool, starts, lengths, slots, fresh, *, max_len):
    """The dispatch entry for ``delta_rule_varlen_slots``: the kernels where the shapes allow, else the jnp op."""
    from apriel2_jax.ops.delta_rule import delta_rule_varlen_slots

    if not supported(q, v):
        return delta_rule_varlen_slots(q, k, v, g, beta, state_pool, starts, lengths, slots, fresh, max_len=max_len)
    return delta_rule_prefill(q, k, v, g, beta, state_pool, starts, lengths, slots, fresh)
