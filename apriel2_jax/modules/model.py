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
from ..placement import Placement
from .layers import Linear, make_norm
from .mixers import active, build_mixer
from .mlp import MLP

Cache = tuple[dict[str, jax.Array], ...]


class Block(nnx.Module):
    def __init__(self, cfg: BlockConfig, hidden_size: int, norm_eps: float, *, dtype, rngs: nnx.Rngs):
        norm_type = cfg.normalization.type
        self.input_layernorm = make_norm(norm_type, hidden_size, norm_eps, dtype=dtype)
        self.mixer = build_mixer(cfg.mixer, hidden_size, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = make_norm(norm_type, hidden_size, norm_eps, dtype=dtype)
        self.mlp = MLP(cfg.mlp, hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, mixer_name: str | None, state: dict | None):
        mixed, state = active(self.mixer, mixer_name)(self.input_layernorm(x), positions, state)
        x = x + mixed
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, state


class Decoder(nnx.Module):
    def __init__(self, config: Apriel2Config, *, dtype, rngs: nnx.Rngs):
        eps = config.block_norm_epsilon  # QUIRK: the head epsilon (spec §2.1)
        self.blocks = nnx.List([Block(b, config.hidden_size, eps, dtype=dtype, rngs=rngs) for b in config.blocks])


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param((0.02 * jax.random.normal(rngs.params(), (vocab_size, hidden_size))).astype(dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


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

    def init_cache(self, batch: int, max_len: int, placement: Placement) -> Cache:
        """Empty per-layer states for ``batch`` sequences of up to ``max_len`` tokens under ``placement``."""
        return tuple(
            active(block.mixer, name).init_state(batch, max_len, self.dtype)
            for block, name in zip(self.model.decoder.blocks, placement)
        )

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
        x = self.model.norm(x)
        if self.lm_head is not None:
            logits = self.lm_head(x)
        else:
            logits = jnp.einsum("btd,vd->btv", x, self.model.embed_tokens.weight[...])
        return logits, (None if cache is None else tuple(new_cache))
