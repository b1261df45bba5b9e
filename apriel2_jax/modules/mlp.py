"""Block MLP (spec §2.2): gated (MistralMLP, no biases) or plain up/down."""

from __future__ import annotations

import jax
from flax import nnx

from ..config import MLPConfig
from ..ops.norms import activation
from .layers import Linear


class MLP(nnx.Module):
    def __init__(self, cfg: MLPConfig, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.activation = cfg.activation
        if cfg.gated:
            self.gate_proj = Linear(hidden_size, cfg.intermediate_size, False, dtype=dtype, rngs=rngs)
        else:
            self.gate_proj = None
        self.up_proj = Linear(hidden_size, cfg.intermediate_size, cfg.up_bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(cfg.intermediate_size, hidden_size, cfg.down_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gate_proj is not None:
            return self.down_proj(activation(self.activation, self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(activation(self.activation, self.up_proj(x)))
