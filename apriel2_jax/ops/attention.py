"""Causal attention with GQA and an optional sliding window over explicit key positions (spec §2.3).

The op sees keys as a set of (position, valid) slots, so the same function serves a plain forward, a dense
per-sequence cache, and (later) K/V gathered from pages: the mask is derived from positions, never from slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .precision import einsum

F32 = jnp.float32


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    kv_valid: jax.Array | None = None,
    window: int | None = None,
) -> jax.Array:
    """q: [B, T, H, D]; k, v: [B, S, G, D] with G dividing H (query head h reads KV head h // (H/G)).

    q_positions: [B, T]; kv_positions: [B, S] absolute token positions; kv_valid: [B, S] bool (None: all valid).
    Each query at position p sees keys at positions p' with p' <= p, and p' > p - window when window is set.
    Scores in the input dtype, softmax in fp32 then cast back (HF eager). Returns [B, T, H, D].
    """
    batch, length, heads, head_dim = q.shape
    groups = k.shape[2]
    rep = heads // groups
    qg = q.reshape(batch, length, groups, rep, head_dim)
    scores = einsum("btgrd,bsgd->bgrts", qg, k) * (head_dim**-0.5)
    qp = q_positions[:, :, None]
    kp = kv_positions[:, None, :]
    mask = kp <= qp
    if window is not None:
        mask = mask & (kp > qp - window)
    if kv_valid is not None:
        mask = mask & kv_valid[:, None, :]
    scores = jnp.where(mask[:, None, None], scores.astype(F32), jnp.finfo(F32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = einsum("bgrts,bsgd->btgrd", probs, v)
    return out.reshape(batch, length, heads, head_dim)
