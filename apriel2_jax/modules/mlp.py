"""Block MLP (spec §2.2): gated (MistralMLP, no biases) or plain up/down."""

from __future__ import annotations

import jax
from flax import nnx

from ..config import MLPConfig
from ..dispatch import kernel
from ..ops.norms import activation
from .layers import Linear, RMSNorm, residual_projection


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

    def decode_residual(self, x: jax.Array, norm) -> jax.Array | None:
        """``x + mlp(norm(x))`` for one-token rows [S, 1, D]: the whole MLP as one kernel where the backend has
        ``gated_mlp_residual``, else the norm and gate/up projections in one kernel and the down projection added
        to ``x`` in another; None where no kernel can run (none on this backend, a plain MLP, biases, a
        LayerNorm)."""
        if self.gate_proj is None or not isinstance(norm, RMSNorm) or self.up_proj.bias is not None:
            return None
        whole = kernel("gated_mlp_residual")
        # a tensor-parallel down projection sums over devices (psum), which the whole-MLP kernel does not do
        if whole is not None and self.down_proj.bias is None and self.down_proj.reduce_axis is None:
            return whole(x[:, 0], norm.weight[...], norm.eps, self.gate_proj.weight[...], self.up_proj.weight[...],
                         self.down_proj.weight[...], self.activation)[:, None]
        fused = kernel("norm_gated_mlp")
        if fused is None:
            return None
        hidden = fused(
            x[:, 0], norm.weight[...], norm.eps, self.gate_proj.weight[...], self.up_proj.weight[...], self.activation
        )
        return residual_projection(self.down_proj, hidden, x)
