"""The Apriel2 decoder: blocks, the full model, and the causal LM head (spec §2.1).

State ("cache") is explicit: a tuple with one entry per layer, the state dict of the layer's *active* mixer
(attention K/V, or conv + recurrent state). ``cache=None`` runs a plain full forward from empty states.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import Apriel2Config, BlockConfig
from ..ops.precision import einsum
from ..placement import Placement
from .attention import Attention
from .layers import Linear, make_norm
from .mixers import active, build_mixer
from .mlp import MLP
from .paged import PagedBatch, gather_rows, scatter_rows

Cache = tuple[dict[str, jax.Array], ...]


def checkpoint_key(path: tuple) -> str:
    """The HF checkpoint key of a parameter at ``path`` in the model's state (the tree mirrors the HF keys)."""
    return ".".join(str(p) for p in path)


class Block(nnx.Module):
    def __init__(self, cfg: BlockConfig, hidden_size: int, norm_eps: float, *, dtype, rngs: nnx.Rngs):
        norm_type = cfg.normalization.type
        self.input_layernorm = make_norm(norm_type, hidden_size, norm_eps, dtype=dtype)
        self.mixer = build_mixer(cfg.mixer, hidden_size, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = make_norm(norm_type, hidden_size, norm_eps, dtype=dtype)
        self.mlp = MLP(cfg.mlp, hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, mixer_name: str | None, state: dict | None):
        mixed, state = active(self.mixer, mixer_name)(self.input_layernorm(x), positions, state)
        return self._finish(x, mixed), state

    def paged(self, x: jax.Array, batch: PagedBatch, mixer_name: str | None, cache: dict):
        """Engine path: ``cache`` is this layer's page pool (attention) or state-slot pool (recurrent)."""
        mixer = active(self.mixer, mixer_name)
        if x.shape[1] == 1 and hasattr(mixer, "fused_decode"):
            fused = mixer.fused_decode(self.input_layernorm)
            if fused is not None:  # the norm and projections in fused kernels (ops.decode_fused)
                x, cache = mixer.paged_decode_residual(fused, x, self.input_layernorm, batch, cache)
                return self._mlp_residual(x), cache
        h = normalized_once(self.input_layernorm(x))
        if isinstance(mixer, Attention):
            mixed, cache = mixer.paged(h, batch, cache)
        elif x.shape[1] == 1 and hasattr(mixer, "paged_decode"):
            mixed, cache = mixer.paged_decode(h, batch, cache)
        elif x.shape[1] > 1 and hasattr(mixer, "paged_prefill"):
            # Prefill that reads and writes the slot pool in place (varlen kernels on GPU).
            mixed, cache = mixer.paged_prefill(h, batch, cache)
        else:
            rows = gather_rows(cache, batch.slots, batch.fresh)
            mixed, rows = mixer(h, batch.positions, rows, token_mask=batch.token_mask)
            cache = scatter_rows(cache, batch.slots, rows)
        return self._finish(x, mixed), cache

    def _finish(self, x: jax.Array, mixed: jax.Array) -> jax.Array:
        return self._mlp_residual(x + mixed)

    def _mlp_residual(self, x: jax.Array) -> jax.Array:
        if x.shape[1] == 1:
            out = self.mlp.decode_residual(x, self.post_attention_layernorm)
            if out is not None:
                return out
        return x + self.mlp(normalized_once(self.post_attention_layernorm(x)))


def normalized_once(h: jax.Array) -> jax.Array:
    """A norm's output that several projections read, computed once. For multi-token inputs XLA hands each
    projection to cuBLAS, which cannot take the norm as a prologue, so it recomputes the norm into one fusion per
    consumer (the MLP's gate and up: two 10 µs passes over an 8192-token step's activations, H200). The barrier
    makes it one buffer. One-token (decode) inputs pass through: there XLA fuses the norm into its Triton GEMMs."""
    return jax.lax.optimization_barrier(h) if h.ndim == 3 and h.shape[1] > 1 else h


class Decoder(nnx.Module):
    def __init__(self, config: Apriel2Config, *, dtype, rngs: nnx.Rngs):
        eps = config.block_norm_epsilon  # QUIRK: the head epsilon (spec §2.1)
        self.blocks = nnx.List([Block(b, config.hidden_size, eps, dtype=dtype, rngs=rngs) for b in config.blocks])


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param((0.02 * jax.random.normal(rngs.params(), (vocab_size, hidden_size))).astype(dtype))
        # Tensor parallel: this device holds vocabulary rows [index * rows, (index + 1) * rows) of the mesh axis.
        self.vocab_axis: str | None = None

    def __call__(self, ids: jax.Array) -> jax.Array:
        if self.vocab_axis is None:
            return jnp.take(self.weight[...], ids, axis=0)
        rows = self.weight.shape[0]
        local = ids - jax.lax.axis_index(self.vocab_axis) * rows
        here = (local >= 0) & (local < rows)
        x = jnp.take(self.weight[...], jnp.where(here, local, 0), axis=0)
        return jax.lax.psum(jnp.where(here[..., None], x, jnp.zeros_like(x)), self.vocab_axis)


class Apriel2Model(nnx.Module):
    def __init__(self, config: Apriel2Config, *, dtype, rngs: nnx.Rngs):
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.decoder = Decoder(config, dtype=dtype, rngs=rngs)
        self.norm = make_norm("rms_norm", config.hidden_size, config.head_norm.epsilon, dtype=dtype)


class Apriel2ForCausalLM(nnx.Module):
    def __init__(self, config: Apriel2Config, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dtype = dtype
        self.model = Apriel2Model(config, dtype=dtype, rngs=rngs)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, False, dtype=dtype, rngs=rngs)
        # Tensor parallel: logits are computed for this device's vocabulary rows, gathered over the mesh axis and
        # cut to the checkpoint's vocabulary (the split pads it to a multiple of the mesh size).
        self.vocab_axis: str | None = None
        self.vocab_size = config.vocab_size

    def init_cache(self, batch: int, max_len: int, placement: Placement) -> Cache:
        """Empty per-layer states for ``batch`` sequences of up to ``max_len`` tokens under ``placement``."""
        return tuple(
            active(block.mixer, name).init_state(batch, max_len, self.dtype)
            for block, name in zip(self.model.decoder.blocks, placement)
        )

    def init_paged_cache(self, placement: Placement, pages: dict[str, int], page_size: int, slots: int) -> Cache:
        """Engine caches: per attention layer its family's pages, per recurrent layer ``slots`` state rows."""
        caches = []
        for block, name in zip(self.model.decoder.blocks, placement):
            mixer = active(block.mixer, name)
            if isinstance(mixer, Attention):
                caches.append(mixer.init_pages(pages[mixer.cfg.cache_family], page_size, self.dtype))
            else:
                caches.append(mixer.init_state(slots, 0, self.dtype))
        return tuple(caches)

    def forward_paged(
        self, tokens: jax.Array, batch: PagedBatch, cache: Cache, placement: Placement
    ) -> tuple[jax.Array, Cache]:
        """tokens: [S, T]. Returns the logits of each row's last valid token, [S, V], and the updated caches."""
        x = self.model.embed_tokens(tokens)
        new_cache = []
        for i, block in enumerate(self.model.decoder.blocks):
            x, layer_cache = block.paged(x, batch, placement[i], cache[i])
            new_cache.append(layer_cache)
        last = jnp.take_along_axis(x, batch.last_index[:, None, None], axis=1)[:, 0]
        return self._logits(self.model.norm(last)), tuple(new_cache)

    def _logits(self, x: jax.Array) -> jax.Array:
        if self.lm_head is not None:
            logits = self.lm_head(x)
        else:
            logits = einsum("...d,vd->...v", x, self.model.embed_tokens.weight[...])
        if self.vocab_axis is None:
            return logits
        logits = jax.lax.all_gather(logits, self.vocab_axis, axis=logits.ndim - 1, tiled=True)
        return logits[..., : self.vocab_size]

    def __call__(
        self,
        input_ids: jax.Array,
        placement: Placement,
        positions: jax.Array | None = None,
        cache: Cache | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        """input_ids: [B, T]. positions: [B, T] absolute positions (default 0..T-1; pass them when continuing
        from a cache). Returns logits [B, T, V] and the updated cache (None when ``cache`` is None)."""
        batch, length = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        x = self.model.embed_tokens(input_ids)
        new_cache: list[Any] = []
        for i, block in enumerate(self.model.decoder.blocks):
            x, state = block(x, positions, placement[i], None if cache is None else cache[i])
            new_cache.append(state)
        logits = self._logits(self.model.norm(x))
        return logits, (None if cache is None else tuple(new_cache))
