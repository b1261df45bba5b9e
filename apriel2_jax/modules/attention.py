"""Full and sliding-window attention mixer with RoPE and GQA (spec §2.3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import AttentionConfig
from ..dispatch import op
from ..ops.rope import apply_rope, rope_cos_sin
from .layers import Linear


class Attention(nnx.Module):
    def __init__(self, cfg: AttentionConfig, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        q_size, kv_size = cfg.heads * cfg.head_size, cfg.head_groups * cfg.head_size
        self.q_proj = Linear(hidden_size, q_size, cfg.q_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(hidden_size, kv_size, cfg.k_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(hidden_size, kv_size, cfg.v_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(q_size, hidden_size, cfg.o_bias, dtype=dtype, rngs=rngs)

    def init_state(self, batch: int, max_len: int, dtype) -> dict[str, jax.Array]:
        """A dense per-sequence cache indexed by absolute position: slot p holds the rotated key of token p."""
        shape = (batch, max_len, self.cfg.head_groups, self.cfg.head_size)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def __call__(self, x: jax.Array, positions: jax.Array, state: dict | None):
        cfg = self.cfg
        batch, length, _ = x.shape
        q = self.q_proj(x).reshape(batch, length, cfg.heads, cfg.head_size)
        k = self.k_proj(x).reshape(batch, length, cfg.head_groups, cfg.head_size)
        v = self.v_proj(x).reshape(batch, length, cfg.head_groups, cfg.head_size)
        cos, sin = rope_cos_sin(positions, cfg.head_size, cfg.rotary.theta, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if state is None:
            out = op("attention")(q, k, v, positions, positions, None, cfg.window_size)
        else:
            rows = jnp.arange(batch)[:, None]
            k_cache = state["k"].at[rows, positions].set(k.astype(state["k"].dtype))
            v_cache = state["v"].at[rows, positions].set(v.astype(state["v"].dtype))
            # Slots past the newest token hold zeros or stale data; causality (slot position > query) masks them.
            slots = jnp.broadcast_to(jnp.arange(k_cache.shape[1]), (batch, k_cache.shape[1]))
            out = op("attention")(q, k_cache, v_cache, positions, slots, None, cfg.window_size)
            state = {"k": k_cache, "v": v_cache}
        return self.o_proj(out.reshape(batch, length, cfg.heads * cfg.head_size)), state
