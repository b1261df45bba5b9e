"""Full and sliding-window attention mixer with RoPE and GQA (spec §2.3)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import AttentionConfig
from ..dispatch import kernel, op
from ..ops.paged_attention import page_slots, write_pages
from ..ops.rope import apply_rope, rope_cos_sin
from .layers import Linear, RMSNorm, residual_projection


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

    def init_pages(self, num_pages: int, page_size: int, dtype) -> dict[str, jax.Array]:
        shape = (num_pages, page_size, self.cfg.head_groups, self.cfg.head_size)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def _projections(self, x: jax.Array):
        cfg = self.cfg
        batch, length, _ = x.shape
        q = self.q_proj(x).reshape(batch, length, cfg.heads, cfg.head_size)
        k = self.k_proj(x).reshape(batch, length, cfg.head_groups, cfg.head_size)
        v = self.v_proj(x).reshape(batch, length, cfg.head_groups, cfg.head_size)
        return q, k, v

    def _qkv(self, x: jax.Array, positions: jax.Array):
        q, k, v = self._projections(x)
        cos, sin = rope_cos_sin(positions, self.cfg.head_size, self.cfg.rotary.theta, x.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def paged(self, x: jax.Array, batch, pages: dict[str, jax.Array]):
        """Engine path: write the new K/V into this family's pages, then attend through the block tables. Decode
        (one token per row) runs RoPE, the page writes and attention as one kernel where the backend has it
        (``ops.paged_attention.rope_write_paged_attention``: that chain ran as ~7 kernels per layer)."""
        cfg = self.cfg
        rows, length, _ = x.shape
        fused = kernel("rope_write_paged_attention") if length == 1 else None
        if fused is not None:
            if rows == 1:
                q, k, v = (t[:, 0] for t in self._projections(x))
            else:
                # XLA merges the three matmuls of several rows into one: their outputs side by side are that
                # matmul's output, where three separate arrays would be three copies out of it. (One row's
                # projections are separate reductions, which XLA would fuse into the concatenation instead.)
                qkv = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
                q, k, v = qkv.reshape(rows, cfg.heads + 2 * cfg.head_groups, cfg.head_size), None, None
            out, pages = self._decode_attention(fused, q, k, v, batch, pages)
            return self.o_proj(out.reshape(rows, 1, cfg.heads * cfg.head_size)), pages
        table, first = batch.tables[cfg.cache_family], batch.first_page[cfg.cache_family]
        slots = page_slots(batch.positions, batch.token_mask, table, first, pages["k"].shape[1])
        q, k, v = self._qkv(x, batch.positions)
        pages = {"k": write_pages(pages["k"], k, slots), "v": write_pages(pages["v"], v, slots)}
        out = op("paged_attention")(q, pages["k"], pages["v"], table, first, batch.positions, cfg.window_size)
        return self.o_proj(out.reshape(rows, length, cfg.heads * cfg.head_size)), pages

    def fused_decode(self, norm) -> Callable | None:
        """The fused input norm + Q/K/V projections for this layer (``ops.decode_fused.norm_projections``), or
        None where the chain must run unfused: no kernel on this backend, biases, or a LayerNorm."""
        fused = kernel("norm_projections")
        if fused is None or not isinstance(norm, RMSNorm):
            return None
        if any(p.bias is not None for p in (self.q_proj, self.k_proj, self.v_proj)):
            return None
        return fused

    def paged_decode_residual(self, fused, x: jax.Array, norm: RMSNorm, batch, pages: dict[str, jax.Array]):
        """Engine decode (one token per row) from the residual stream ``x`` [S, 1, D]: the input norm and Q/K/V
        in one kernel (their outputs side by side, the layout the decode attention takes as one buffer), then
        RoPE, the page writes and paged attention, then the output projection added to ``x``. Returns the new
        residual stream and the pages."""
        cfg = self.cfg
        rows = x.shape[0]
        qkv = fused(x[:, 0], norm.weight[...], norm.eps,
                    (self.q_proj.weight[...], self.k_proj.weight[...], self.v_proj.weight[...]))
        qkv = qkv.reshape(rows, cfg.heads + 2 * cfg.head_groups, cfg.head_size)
        out, pages = self._decode_attention(op("rope_write_paged_attention"), qkv, None, None, batch, pages)
        return residual_projection(self.o_proj, out.reshape(rows, cfg.heads * cfg.head_size), x), pages

    def _decode_attention(self, attend, q, k, v, batch, pages: dict[str, jax.Array]):
        """``attend`` (``rope_write_paged_attention``'s kernel or chain) for one-token rows: q [S, H, D] and k, v
        [S, G, D] before RoPE, or k = v = None with q [S, H + 2G, D]. Returns the output [S, H, D] and the pages."""
        cfg = self.cfg
        table, first = batch.tables[cfg.cache_family], batch.first_page[cfg.cache_family]
        slots = page_slots(batch.positions, batch.token_mask, table, first, pages["k"].shape[1])[:, 0]
        cos, sin = rope_cos_sin(batch.positions[:, 0], cfg.head_size, cfg.rotary.theta, q.dtype)
        out, k_pages, v_pages = attend(q, k, v, cos, sin, slots, pages["k"], pages["v"], table, first,
                                       batch.positions, cfg.window_size)
        return out, {"k": k_pages, "v": v_pages}

    def __call__(self, x: jax.Array, positions: jax.Array, state: dict | None, token_mask: jax.Array | None = None):
        """``token_mask`` is accepted for a uniform mixer interface and not needed: right padding sits after every
        valid token, so causality already hides it from valid queries."""
        cfg = self.cfg
        batch, length, _ = x.shape
        q, k, v = self._qkv(x, positions)
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
