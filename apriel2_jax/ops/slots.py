"""The engine's layout for the slot-pool oracles: sequences packed in one flat token buffer, states in a pool of
slots. Shared by the conv, Mamba and delta-rule ``*_slots`` ops (and the engine's gather of state rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def varlen_rows(starts: jax.Array, lengths: jax.Array, max_len: int, n_tokens: int):
    """Padded [S, max_len] view of sequences packed in a flat token buffer (sequence s = tokens
    starts[s] .. starts[s]+lengths[s]-1). Returns (gather indices, clipped into the buffer so padding reads stay
    in bounds; scatter indices, ``n_tokens`` (out of bounds, dropped by ``mode="drop"``) for padding; mask)."""
    pos = jnp.arange(max_len, dtype=jnp.int32)
    mask = pos[None, :] < lengths.astype(jnp.int32)[:, None]
    idx = starts.astype(jnp.int32)[:, None] + pos[None, :]
    return jnp.clip(idx, 0, n_tokens - 1), jnp.where(mask, idx, n_tokens), mask


def slot_rows(pool: jax.Array, slots: jax.Array, fresh: jax.Array) -> jax.Array:
    """Rows ``slots`` of a pool; a fresh row starts from zeros whatever its slot held before."""
    rows = pool[slots]
    return jnp.where(fresh.reshape((-1,) + (1,) * (rows.ndim - 1)), jnp.zeros_like(rows), rows)


def flatten_rows(x: jax.Array) -> jax.Array:
    """[S, T, ...] -> [S*T, ...]: padded rows as a packed token buffer (row s starts at token s*T)."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
