"""Gated delta rule (GDN, spec §2.6) and Kimi delta attention (KDA, spec §2.7) as pure jnp functions.

Both are the same recurrence with a different decay: GDN decays the whole state by a scalar per head, KDA
decays each key channel separately. Per head, at every token (decay, then delta write, then read):

    S <- diag(exp(g_t)) S
    u  = beta_t (v_t - S^T k_t)
    S <- S + k_t u^T
    o_t = S^T q_t

with q, k L2-normalised and q scaled by K^-1/2 (fla's ``use_qk_l2norm_in_kernel``). The state S is [K, V] fp32.

The sequence form is chunked (WY form). Inside a chunk with cumulative log decay G_t = sum_{s<=t} g_s and
state S0 at the chunk start, the writes u solve a unit lower-triangular system

    (I + A) U = diag(beta) (V - (exp(G) * K) S0),   A_ts = beta_t sum_i k_ti k_si exp(G_ti - G_si)  (s < t)

and then O = (exp(G) * Q) S0 + (M o (Q K-decayed^T)) U and S_C = exp(G_C) S0 + (exp(G_C - G) * K)^T U.
Decay ratios exp(G_t - G_s) with s <= t are <= 1, so nothing overflows however strong the decay (KDA has no
lower bound on g). Padding tokens get g = 0, beta = 0: identity updates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .conv import causal_conv1d_decode_slots
from .norms import F32, activation, gated_rms_norm, l2_normalize, softplus
from .precision import einsum
from .slots import slot_rows, varlen_rows

HIGHEST = jax.lax.Precision.HIGHEST


def _ein(spec: str, *operands: jax.Array) -> jax.Array:
    # The recurrence's products, in float32 at every model dtype (its operands are cast to float32 first); the
    # model's projections use ``precision.einsum``, which keeps a bfloat16 model's dots on the default.
    return jnp.einsum(spec, *operands, precision=HIGHEST)


# ----------------------------------------------------------------------------------------------------------------
# Gates


def gdn_gate(a: jax.Array, A_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """GDN log decay, fp32: ``-exp(A_log) * softplus(a + dt_bias)``. a: [..., H_v]."""
    return -jnp.exp(A_log.astype(F32)) * softplus(a.astype(F32) + dt_bias.astype(F32))


def kda_gate(g_raw: jax.Array, A_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """KDA per-channel log decay, fp32. g_raw: [..., H, D]; A_log: [H]; dt_bias: [H*D] (head-major)."""
    heads, dim = g_raw.shape[-2:]
    bias = dt_bias.astype(F32).reshape(heads, dim)
    return -jnp.exp(A_log.astype(F32))[:, None] * softplus(g_raw.astype(F32) + bias)


# ----------------------------------------------------------------------------------------------------------------
# Core recurrence on normalised inputs, one q/k head per value head


def _delta_rule_chunk(state, chunk):
    """One chunk. state: [B,H,K,V]; q,k: [B,H,C,K]; v: [B,H,C,V]; g: [B,H,C,K'] (K' = K or 1); beta: [B,H,C]."""
    q, k, v, g, beta = chunk
    size = q.shape[2]
    cum = jnp.cumsum(g, axis=2)  # [B,H,C,K']
    t_idx = jnp.arange(size)
    incl = t_idx[:, None] >= t_idx[None, :]
    strict = t_idx[:, None] > t_idx[None, :]
    diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [B,H,t,s,K']
    ratio = jnp.exp(jnp.where(incl[:, :, None], diff, -jnp.inf))
    if g.shape[-1] == 1:
        kk = _ein("bhtk,bhsk->bhts", k, k) * ratio[..., 0]
        qk = _ein("bhtk,bhsk->bhts", q, k) * ratio[..., 0]
    else:
        kk = _ein("bhtk,bhsk,bhtsk->bhts", k, k, ratio)
        qk = _ein("bhtk,bhsk,bhtsk->bhts", q, k, ratio)
    a = jnp.where(strict, kk, 0.0) * beta[..., None]
    decay = jnp.exp(cum)
    rhs = beta[..., None] * (v - _ein("bhck,bhkv->bhcv", k * decay, state))
    eye = jnp.eye(size, dtype=F32)
    u = jax.lax.linalg.triangular_solve(eye + a, rhs, left_side=True, lower=True, unit_diagonal=True)
    out = _ein("bhck,bhkv->bhcv", q * decay, state) + _ein("bhts,bhsv->bhtv", jnp.where(incl, qk, 0.0), u)
    last = cum[:, :, -1:, :]  # [B,H,1,K']
    new_state = jnp.exp(last[:, :, 0, :])[..., None] * state + _ein("bhck,bhcv->bhkv", k * jnp.exp(last - cum), u)
    return new_state, out


def delta_rule_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """Normalised inputs, fp32. q, k: [B,T,H,K]; v: [B,T,H,V]; g: [B,T,H,K'] log decay; beta: [B,T,H];
    initial_state: [B,H,K,V]. Returns o [B,T,H,V] and the final state."""
    batch, length, heads, _ = q.shape
    chunk_size = max(1, min(chunk_size, length))
    padded = -(-length // chunk_size) * chunk_size
    pad = padded - length

    def prep(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((batch, padded // chunk_size, chunk_size) + x.shape[2:])
        # -> [N, B, H, C, ...] so that the scan runs over chunks
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

    chunks = tuple(prep(x.astype(F32)) for x in (q, k, v, g, beta))
    final, out = jax.lax.scan(_delta_rule_chunk, initial_state.astype(F32), chunks)
    out = jnp.moveaxis(out, 0, 1)  # [B, N, H, C, V]
    out = jnp.moveaxis(out, 2, 3).reshape(batch, padded, heads, -1)[:, :length]
    return out, final


def delta_rule_step(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token, normalised fp32 inputs. q, k: [B,H,K]; v: [B,H,V]; g: [B,H,K']; beta: [B,H]; state [B,H,K,V]."""
    state = jnp.exp(g)[..., None] * state
    u = beta[..., None] * (v - _ein("bhk,bhkv->bhv", k, state))
    state = state + k[..., :, None] * u[..., None, :]
    return _ein("bhk,bhkv->bhv", q, state), state


def _prepare_qk(q: jax.Array, k: jax.Array, heads: int) -> tuple[jax.Array, jax.Array]:
    """L2-normalise, scale q by K^-1/2, and expand key heads to ``heads`` (repeat_interleave)."""
    key_heads, key_dim = q.shape[-2:]
    q = l2_normalize(q) * (key_dim**-0.5)
    k = l2_normalize(k)
    if heads != key_heads:
        q = jnp.repeat(q, heads // key_heads, axis=-2)
        k = jnp.repeat(k, heads // key_heads, axis=-2)
    return q, k


# ----------------------------------------------------------------------------------------------------------------
# GDN


def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """GDN sequence form. q, k: [B,T,H_k,K] (raw, post-conv); v: [B,T,H_v,V]; g: [B,T,H_v] log decay (fp32);
    beta: [B,T,H_v]; initial_state: [B,H_v,K,V] fp32. Value head j reads key head j // (H_v/H_k).
    Returns o [B,T,H_v,V] in v's dtype and the final state [B,H_v,K,V] fp32."""
    qn, kn = _prepare_qk(q, k, v.shape[2])
    out, state = delta_rule_chunked(qn, kn, v, g[..., None], beta, initial_state, chunk_size)
    return out.astype(v.dtype), state


def gated_delta_rule_step(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """GDN one-token form: q, k [B,H_k,K]; v [B,H_v,V]; g, beta [B,H_v]; state [B,H_v,K,V]."""
    qn, kn = _prepare_qk(q, k, v.shape[1])
    out, state = delta_rule_step(qn, kn, v.astype(F32), g.astype(F32)[..., None], beta.astype(F32), state)
    return out.astype(v.dtype), state


# ----------------------------------------------------------------------------------------------------------------
# KDA


def kda_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array,
    chunk_size: int = 16,
) -> tuple[jax.Array, jax.Array]:
    """KDA sequence form. q, k, v: [B,T,H,D]; g: [B,T,H,D] per-channel log decay (fp32); beta: [B,T,H] fp32;
    initial_state: [B,H,D,D] fp32. Returns o [B,T,H,D] in v's dtype and the final state.

    The default chunk is small because the pairwise decay tensor is [C, C, D] per head."""
    qn, kn = _prepare_qk(q, k, v.shape[2])
    out, state = delta_rule_chunked(qn, kn, v, g, beta, initial_state, chunk_size)
    return out.astype(v.dtype), state


def kda_delta_rule_step(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """KDA one-token form: q, k, v, g [B,H,D]; beta [B,H]; state [B,H,D,D]."""
    qn, kn = _prepare_qk(q, k, v.shape[1])
    out, state = delta_rule_step(qn, kn, v.astype(F32), g.astype(F32), beta.astype(F32), state)
    return out.astype(v.dtype), state


# ----------------------------------------------------------------------------------------------------------------
# Decode over a state-slot pool (the engine's layout): the oracle of pallas_kernels.delta_rule_decode


def delta_rule_decode_slots(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state_pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token per row against rows ``slots`` of a state pool. q, k: [B,H_k,K] raw; v: [B,H,V]; g: [B,H]
    (GDN) or [B,H,K] (KDA) log decay; beta: [B,H]; state_pool: [N,H,K,V] fp32; slots: [B]; fresh: [B] bool,
    rows that start from a zero state. Returns o [B,H,V] in v's dtype and the updated pool."""
    qn, kn = _prepare_qk(q, k, v.shape[1])
    decay = (g[..., None] if g.ndim == 2 else g).astype(F32)
    rows = slot_rows(state_pool, slots, fresh)
    out, rows = delta_rule_step(qn, kn, v.astype(F32), decay, beta.astype(F32), rows)
    return out.astype(v.dtype), state_pool.at[slots].set(rows)


def split_packed_qkv(mixed: jax.Array, key_heads: int, key_dim: int, value_heads: int):
    """q, k [..., H_k, K] and v [..., H, V] from GDN's conv output [..., 2 H_k K + H V] (q heads, then k heads,
    then v heads)."""
    lead = mixed.shape[:-1]
    key_size = key_heads * key_dim
    value_size = mixed.shape[-1] - 2 * key_size if mixed.ndim else 0
    if value_size <= 0 or value_size % value_heads:
        raise ValueError(f"packed q|k|v must be [..., 2 * {key_heads} * {key_dim} + {value_heads} * V], got "
                         f"{list(mixed.shape)}")
    q = mixed[..., :key_size].reshape(*lead, key_heads, key_dim)
    k = mixed[..., key_size : 2 * key_size].reshape(*lead, key_heads, key_dim)
    v = mixed[..., 2 * key_size :].reshape(*lead, value_heads, value_size // value_heads)
    return q, k, v


def delta_rule_decode_slots_packed(
    mixed: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state_pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    *,
    key_heads: int,
    key_dim: int,
) -> tuple[jax.Array, jax.Array]:
    """``delta_rule_decode_slots`` with q, k and v side by side in one buffer, as GDN's conv leaves them:
    mixed [B, 2 H_k K + H V] (q heads, then k heads, then v heads); the value heads H are g's and beta's.
    A kernel reading the buffer in place saves the step three slice copies per GDN layer."""
    if mixed.ndim != 2:
        raise ValueError(f"packed q|k|v must be [B, 2 * {key_heads} * {key_dim} + H * V], got {list(mixed.shape)}")
    q, k, v = split_packed_qkv(mixed, key_heads, key_dim, beta.shape[1])
    return delta_rule_decode_slots(q, k, v, g, beta, state_pool, slots, fresh)


def _columns(src: jax.Array, offset: int, width: int, what: str) -> jax.Array:
    """Columns [offset, offset + width) of a [B, *] buffer (an input read in place by the kernels)."""
    if src.ndim != 2 or not 0 <= offset <= src.shape[1] - width:
        raise ValueError(f"{what}: needs a [B, >= {offset} + {width}] buffer, got {list(src.shape)}")
    return src[:, offset : offset + width]


def gdn_decode_gated_slots(
    mixed: jax.Array,
    proj: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    norm_weight: jax.Array,
    state_pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    *,
    key_heads: int,
    key_dim: int,
    z_offset: int,
    ba_offset: int,
    eps: float,
) -> tuple[jax.Array, jax.Array]:
    """GDN's decode step from its conv output to its output norm, as the module chains it: the gates from the raw
    b, a projections (``beta = sigmoid(b)`` in the model dtype, ``g = gdn_gate(a)``), the update over the packed
    q|k|v (``delta_rule_decode_slots_packed``), then ``gated_rms_norm(o, z)`` (silu). mixed: [B, 2 H_k K + H V]
    (or wider: its first columns, V being the norm weight's size; the projections buffer after the conv wrote
    over its q|k|v);
    proj: the input projections' output [B, *] holding z [H V] at column ``z_offset`` and b, a [H each] at
    ``ba_offset`` (one kernel reads them there: slices would be copies); A_log, dt_bias: [H]; norm_weight: [V].
    Returns the normed output [B, H, V] in mixed's dtype and the pool."""
    heads = A_log.shape[0]
    value_size = heads * norm_weight.shape[0]
    mixed = _columns(mixed, 0, 2 * key_heads * key_dim + value_size, "q|k|v")
    ba = _columns(proj, ba_offset, 2 * heads, "b|a gates")
    z = _columns(proj, z_offset, value_size, "z").reshape(-1, heads, value_size // heads)
    beta = activation("sigmoid", ba[:, :heads])
    g = gdn_gate(ba[:, heads:], A_log, dt_bias)
    o, state_pool = delta_rule_decode_slots_packed(mixed, g, beta, state_pool, slots, fresh, key_heads=key_heads,
                                                   key_dim=key_dim)
    return gated_rms_norm(o, z, norm_weight, eps, "silu"), state_pool


def kda_decode_gated_slots(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    proj: jax.Array,
    f_b_weight: jax.Array,
    g_b_weight: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    norm_weight: jax.Array,
    state_pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    *,
    f_a_offset: int,
    g_a_offset: int,
    beta_offset: int,
    eps: float,
    norm_activation: str,
) -> tuple[jax.Array, jax.Array]:
    """KDA's decode step from its convs' outputs to its output norm, as the module chains it: the low-rank gates'
    second projections (``g_raw = f_b(f_a)``, ``gate = g_b(g_a)``, each rounded to the dtype as ``Linear``), the
    per-channel decay ``kda_gate(g_raw)``, ``beta = sigmoid(beta_raw)`` in fp32, the update, then
    ``gated_rms_norm(o, gate)`` with ``norm_activation``. q, k, v: [B, H D] (head-major); proj: the input
    projections' output [B, *] holding f_a and g_a [R] at ``f_a_offset`` and ``g_a_offset`` and the raw beta [H]
    at ``beta_offset``; f_b_weight, g_b_weight: [H D, R] (``Linear``'s [out, in]); A_log: [H]; dt_bias: [H D];
    norm_weight: [D]. Returns the normed output [B, H, D] in v's dtype and the pool."""
    heads, rank = A_log.shape[0], f_b_weight.shape[1]
    f_a = _columns(proj, f_a_offset, rank, "f_a")
    g_a = _columns(proj, g_a_offset, rank, "g_a")
    g_raw, gate = (einsum("bi,oi->bo", x, w) for x, w in ((f_a, f_b_weight), (g_a, g_b_weight)))
    shape = (q.shape[0], heads, q.shape[1] // heads)
    q, k, v, g_raw, gate = (t.reshape(shape) for t in (q, k, v, g_raw, gate))
    beta = jax.nn.sigmoid(_columns(proj, beta_offset, heads, "beta").astype(F32))
    g = kda_gate(g_raw, A_log, dt_bias)
    o, state_pool = delta_rule_decode_slots(q, k, v, g, beta, state_pool, slots, fresh)
    return gated_rms_norm(o, gate, norm_weight, eps, norm_activation), state_pool


def kda_decode_conv_gated_slots(
    proj: jax.Array,
    conv_weights: tuple[jax.Array, jax.Array, jax.Array],
    conv_biases: tuple[jax.Array | None, jax.Array | None, jax.Array | None],
    conv_pools: tuple[jax.Array, jax.Array, jax.Array],
    f_b_weight: jax.Array,
    g_b_weight: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    norm_weight: jax.Array,
    state_pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    *,
    f_a_offset: int,
    g_a_offset: int,
    beta_offset: int,
    eps: float,
    norm_activation: str,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
    """KDA's whole decode step from its input projections' output to its output norm: the three short convs
    (silu) of q, k and v, read in place at columns 0, H D and 2 H D of ``proj`` (``causal_conv1d_decode_slots``),
    then ``kda_decode_gated_slots``. conv_weights: [H D, Kc] each; conv_biases: [H D] or None; conv_pools:
    [P, Kc-1, H D] each. One kernel runs it all: each (head, row) owns its head's conv channels as it owns its
    state. Returns the normed output [B, H, D], the three conv pools and the state pool."""
    size = conv_weights[0].shape[0]
    convs = [causal_conv1d_decode_slots(proj, w, b, pool, slots, fresh, x_offset=i * size)
             for i, (w, b, pool) in enumerate(zip(conv_weights, conv_biases, conv_pools))]
    y, state_pool = kda_decode_gated_slots(
        *(c[0] for c in convs), proj, f_b_weight, g_b_weight, A_log, dt_bias, norm_weight, state_pool, slots, fresh,
        f_a_offset=f_a_offset, g_a_offset=g_a_offset, beta_offset=beta_offset, eps=eps, norm_activation=norm_activation,
    )
    return y, tuple(c[1] for c in convs), state_pool


# ----------------------------------------------------------------------------------------------------------------
# Prefill over a flat token buffer against a state-slot pool (the engine's layout): the oracle of
# pallas_kernels.delta_rule_prefill


def delta_rule_varlen_slots(
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
    max_len: int,
) -> tuple[jax.Array, jax.Array]:
    """GDN (g: [N, H]) or KDA (g: [N, H, K]) over sequences packed in one token buffer.

    q, k: [N, H_k, K] raw (post-conv); v: [N, H, V]; g: log decay, fp32; beta: [N, H]. Sequence s is tokens
    ``starts[s] : starts[s] + lengths[s]`` (``lengths[s] <= max_len``, static); it starts from row ``slots[s]`` of
    ``state_pool`` [P, H, K, V] fp32 (zeros where ``fresh[s]``) and its final state is written back there.
    Tokens outside every sequence get a zero output. Returns o [N, H, V] in v's dtype and the pool."""
    gather, scatter, valid = varlen_rows(starts, lengths, max_len, q.shape[0])
    take = lambda x: x[gather]  # noqa: E731  [S, max_len, ...]
    mask = valid[..., None] if g.ndim == 2 else valid[..., None, None]
    g_rows = jnp.where(mask, take(g).astype(F32), 0.0)
    beta_rows = jnp.where(valid[..., None], take(beta), jnp.zeros_like(take(beta)))
    fn = gated_delta_rule if g.ndim == 2 else kda_delta_rule
    out, final = fn(take(q), take(k), take(v), g_rows, beta_rows, slot_rows(state_pool, slots, fresh))
    o = jnp.zeros(v.shape, v.dtype).at[scatter].set(out, mode="drop")
    return o, state_pool.at[slots].set(final)


# ----------------------------------------------------------------------------------------------------------------
# Decode with the short convolution and the gates folded in: the oracles of pallas_kernels.delta_rule_decode_fused


def gdn_decode_fused_slots(
    qkv: jax.Array,
    conv_weight: jax.Array,
    conv_pool: jax.Array,
    a: jax.Array,
    b: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    state_pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    *,
    key_heads: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GDN decode from the pre-conv projection: qkv [B, 2*H_k*K + H*V] (q | k | v channels), conv_weight [C, Kc],
    conv_pool [P, Kc-1, C]; gate inputs a, b [B, H] (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) in
    b's dtype). Returns o [B, H, V], the conv pool and the state pool."""
    heads, key_dim, value_dim = state_pool.shape[1:]
    mixed, conv_pool = causal_conv1d_decode_slots(qkv, conv_weight, None, conv_pool, slots, fresh)
    size = key_heads * key_dim
    q = mixed[:, :size].reshape(-1, key_heads, key_dim)
    k = mixed[:, size : 2 * size].reshape(-1, key_heads, key_dim)
    v = mixed[:, 2 * size :].reshape(-1, heads, value_dim)
    o, state_pool = delta_rule_decode_slots(q, k, v, gdn_gate(a, A_log, dt_bias), activation("sigmoid", b), state_pool,
                                            slots, fresh)
    return o, conv_pool, state_pool


def kda_decode_fused_slots(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    conv_weights: tuple[jax.Array, jax.Array, jax.Array],
    conv_pools: tuple[jax.Array, jax.Array, jax.Array],
    g_raw: jax.Array,
    beta: jax.Array,
    A_log: jax.Array,
    dt_bias: jax.Array,
    state_pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
    """KDA decode from the pre-conv projections q, k, v [B, H*D] with one conv each; g_raw [B, H, D] (the gate is
    ``kda_gate``), beta [B, H] already a sigmoid. Returns o [B, H, D], the three conv pools and the state pool."""
    heads, dim = state_pool.shape[1:3]
    pools, mixed = [], []
    for x, weight, pool in zip((q, k, v), conv_weights, conv_pools):
        y, pool = causal_conv1d_decode_slots(x, weight, None, pool, slots, fresh)
        mixed.append(y.reshape(-1, heads, dim))
        pools.append(pool)
    o, state_pool = delta_rule_decode_slots(*mixed, kda_gate(g_raw, A_log, dt_bias), beta, state_pool, slots, fresh)
    return o, tuple(pools), state_pool
