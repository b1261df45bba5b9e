"""Jitted forward passes over a loaded model: full forward, cached prefill/decode, greedy generation.

This is the simple per-sequence path (dense caches) used for parity checks and tests; the serving engine
builds on the same modules with paged caches.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .modules import Apriel2ForCausalLM, Cache
from .placement import Placement


class ModelRunner:
    def __init__(self, model: Apriel2ForCausalLM):
        self.config = model.config
        self.graphdef, self.params = nnx.split(model)
        self._forward = jax.jit(self._apply, static_argnames=("placement",))
        self._step = jax.jit(self._apply, static_argnames=("placement",), donate_argnames=("cache",))

    def _apply(self, params, input_ids, positions, cache, placement):
        model = nnx.merge(self.graphdef, params)
        return model(input_ids, placement, positions, cache)

    @property
    def model(self) -> Apriel2ForCausalLM:
        return nnx.merge(self.graphdef, self.params)

    def init_cache(self, batch: int, max_len: int, placement: Placement) -> Cache:
        return self.model.init_cache(batch, max_len, placement)

    def forward(self, input_ids, placement: Placement) -> jax.Array:
        """Full forward with no cache. input_ids: [B, T]. Returns logits [B, T, V]."""
        logits, _ = self._forward(self.params, jnp.asarray(input_ids), None, None, placement=placement)
        return logits

    def extend(self, input_ids, start: int, cache: Cache, placement: Placement) -> tuple[jax.Array, Cache]:
        """Feed tokens at positions start.. on top of ``cache`` (donated). Returns logits and the new cache."""
        ids = jnp.asarray(input_ids)
        batch, length = ids.shape
        positions = jnp.broadcast_to(jnp.arange(start, start + length, dtype=jnp.int32), (batch, length))
        return self._step(self.params, ids, positions, cache, placement=placement)

    def greedy(self, prompt_ids, new_tokens: int, placement: Placement, max_len: int | None = None) -> np.ndarray:
        """Greedy continuation (no EOS stop): prefill the prompt, then one decode step per token.
        ``max_len`` sizes the cache (default prompt + new tokens); equal sizes reuse compiled steps."""
        prompt = jnp.asarray(prompt_ids)
        batch, length = prompt.shape
        cache = self.init_cache(batch, max(max_len or 0, length + new_tokens), placement)
        logits, cache = self.extend(prompt, 0, cache, placement)
        tokens = []
        token = jnp.argmax(logits[:, -1], axis=-1)
        for i in range(new_tokens):
            tokens.append(token)
            if i + 1 < new_tokens:
                logits, cache = self.extend(token[:, None], length + i, cache, placement)
                token = jnp.argmax(logits[:, -1], axis=-1)
        return np.asarray(jnp.stack(tokens, axis=1))


__all__ = ["ModelRunner"]
