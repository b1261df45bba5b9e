"""Mamba-1 selective scan with Apriel-H1 ``d_xb`` grouping (spec §2.8), fp32 state.

Per channel c (head h = c // N) with state s_c in R^N:

    s_c <- exp(dt_c A_c) * s_c + dt_c u_c B_{group(h)}
    y_c  = <C_h, s_c> + D_c u_c,     then y <- y * silu(z)

where dt = softplus(delta + dt_bias). B comes per group (D_xb / N groups, head h uses group h // rho) and C per
head (D_in / N heads). The sequence form scans over chunks, each chunk solved with an associative scan of the
diagonal linear recurrence; padding gets dt = 0, an identity update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .norms import F32, softplus
from .slots import slot_rows, varlen_rows


def _expand(x: jax.Array, channels: int) -> jax.Array:
    """[..., n, N] per head or group -> [..., channels, N] per channel (channel c uses index (c // N) // rep)."""
    n, state = x.shape[-2:]
    heads = channels // state
    per_head = jnp.repeat(x, heads // n, axis=-2)  # [..., heads, N]
    return jnp.repeat(per_head, state, axis=-2)  # [..., channels, N]


def _combine(left, right):
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2


def _chunk(state, chunk):
    """state: [B, Din, N]; per chunk: u, dt [B, C, Din]; A [Din, N]; b, c [B, C, Din, N]."""
    u, dt, A, b, c = chunk
    decay = jnp.exp(dt[..., None] * A)
    drive = (dt * u)[..., None] * b
    cum_decay, cum_drive = jax.lax.associative_scan(_combine, (decay, drive), axis=1)
    states = cum_decay * state[:, None] + cum_drive  # [B, C, Din, N]
    y = jnp.sum(states * c, axis=-1)
    return states[:, -1], y


def selective_scan(
    u: jax.Array,
    delta: jax.Array,
    A_log: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array,
    z: jax.Array,
    dt_bias: jax.Array | None,
    initial_state: jax.Array,
    chunk_size: int = 32,
    mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Sequence form. u, delta, z: [B,T,Din]; A_log: [Din,N]; B: [B,T,n_groups,N]; C: [B,T,n_heads,N];
    D: [Din]; dt_bias: [Din] or None; initial_state: [B,Din,N] fp32; mask: [B,T] bool, False for padding
    tokens, which then leave the state untouched (dt = 0).
    Returns y [B,T,Din] in u's dtype and the final state."""
    batch, length, channels = u.shape
    dt = delta.astype(F32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(F32)
    dt = softplus(dt)
    if mask is not None:
        dt = jnp.where(mask[..., None], dt, 0.0)
    A = -jnp.exp(A_log.astype(F32))
    chunk_size = max(1, min(chunk_size, length))
    padded = -(-length // chunk_size) * chunk_size
    pad = padded - length

    def prep(x):
        x = jnp.pad(x.astype(F32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((batch, padded // chunk_size, chunk_size) + x.shape[2:]), 1, 0)

    u32 = prep(u)
    dt = prep(dt)  # padded tokens: dt = 0 -> decay 1, drive 0
    b = prep(_expand(B, channels))
    c = prep(_expand(C, channels))
    final, y = jax.lax.scan(lambda s, x: _chunk(s, (x[0], x[1], A, x[2], x[3])), initial_state.astype(F32), (u32, dt, b, c))
    y = jnp.moveaxis(y, 0, 1).reshape(batch, padded, channels)[:, :length]
    y = (y + D.astype(F32) * u.astype(F32)) * jax.nn.silu(z.astype(F32))
    return y.astype(u.dtype), final


def selective_scan_step(
    u: jax.Array,
    delta: jax.Array,
    A_log: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array,
    z: jax.Array,
    dt_bias: jax.Array | None,
    state: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token. u, delta, z: [B,Din]; B: [B,n_groups,N]; C: [B,n_heads,N]; state: [B,Din,N] fp32."""
    channels = u.shape[-1]
    dt = delta.astype(F32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(F32)
    dt = softplus(dt)
    A = -jnp.exp(A_log.astype(F32))
    u32 = u.astype(F32)
    state = jnp.exp(dt[..., None] * A) * state + (dt * u32)[..., None] * _expand(B.astype(F32), channels)
    y = jnp.sum(state * _expand(C.astype(F32), channels), axis=-1)
    y = (y + D.astype(F32) * u32) * jax.nn.silu(z.astype(F32))
    return y.astype(u.dtype), state


def selective_scan_varlen_slots(
    u: jax.Array,
    delta: jax.Array,
    A_log: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array,
    z: jax.Array,
    dt_bias: jax.Array | None,
    state_pool: jax.Array,
    starts: jax.Array,
    lengths: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    *,
    max_len: int,
) -> tuple[jax.Array, jax.Array]:
    """Varlen form over the engine's state-slot pool (the oracle of the Pallas kernel).

    Per-token arrays are flat: u, delta, z [N_tokens, Din]; B [N_tokens, n_groups, N]; C [N_tokens, n_heads, N].
    Sequence s = tokens starts[s] .. starts[s]+lengths[s]-1 (lengths may be 0); state_pool [N_slots, Din, N] fp32;
    slots [S] pool row per sequence; fresh [S] bool, start from zeros instead of the pool row; max_len: static
    bound on lengths (longer sequences would be truncated).
    Returns y [N_tokens, Din] (zeros at tokens no sequence covers) and the pool with rows ``slots`` of
    sequences with lengths > 0 replaced by their final states; rows of empty sequences are left untouched.
    """
    n_tokens = u.shape[0]
    gather, scatter, mask = varlen_rows(starts, lengths, max_len, n_tokens)
    y, final = selective_scan(
        u[gather], delta[gather], A_log, B[gather], C[gather], D, z[gather], dt_bias,
        slot_rows(state_pool, slots, fresh), mask=mask
    )
    y_flat = jnp.zeros_like(u).at[scatter].set(y, mode="drop")
    write = jnp.where(lengths > 0, slots, state_pool.shape[0])
    return y_flat, state_pool.at[write].set(final, mode="drop")


def selective_scan_decode_slots(
    u: jax.Array,
    delta: jax.Array,
    A_log: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array,
    z: jax.Array,
    dt_bias: jax.Array | None,
    state_pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token per row against the slot pool. u, delta, z: [S, Din]; B: [S, n_groups, N]; C: [S, n_heads, N];
    state_pool: [N_slots, Din, N] fp32. Every row writes its slot (padding rows write the sink slot 0).
    Returns y [S, Din] and the pool."""
    rows = slot_rows(state_pool, slots, fresh)
    y, rows = selective_scan_step(u, delta, A_log, B, C, D, z, dt_bias, rows)
    return y, state_pool.at[slots].set(rows)
