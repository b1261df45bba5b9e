"""Parameter holders shared by every mixer: Linear, depthwise conv weights, norms.

Weights keep the PyTorch checkpoint layout (Linear ``weight`` is [out, in], conv ``weight`` is [C, 1, K]) so the
parameter tree mirrors the HF key paths one to one and a checkpoint loads without a host-side transpose; the
matmuls contract the right axis instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..dispatch import kernel
from ..ops import norms
from ..ops.precision import einsum


def _normal(rngs: nnx.Rngs, shape, dtype, std: float = 0.02) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (out_features, in_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        # Set on the per-device model of a tensor-parallel run (``apriel2_jax.tensor_parallel``) for the output
        # projections, whose input is split over the mesh: partial products are summed, then the bias added once.
        self.reduce_axis: str | None = None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = einsum("...i,oi->...o", x, self.weight[...])
        if self.reduce_axis is not None:
            y = jax.lax.psum(y, self.reduce_axis)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


def residual_projection(linear: Linear, x: jax.Array, residual: jax.Array) -> jax.Array:
    """``residual + linear(x)`` for one-token rows (x [S, K], residual [S, 1, N]), as one kernel where the
    backend has ``matmul_add`` and the projection is a plain local matmul (no bias, no tensor-parallel sum)."""
    fused = kernel("matmul_add")
    if fused is None or linear.bias is not None or linear.reduce_axis is not None:
        return residual + linear(x)[:, None]
    return fused(x, linear.weight[...], residual[:, 0])[:, None]


class DepthwiseConv(nnx.Module):
    """Weights of a causal depthwise conv1d; the math is ``ops.conv`` (through the dispatch point)."""

    def __init__(self, channels: int, kernel_size: int, bias: bool, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (channels, 1, kernel_size), dtype, std=kernel_size**-0.5))
        self.bias = nnx.Param(jnp.zeros((channels,), dtype)) if bias else None

    @property
    def taps(self) -> jax.Array:
        """[C, K]"""
        return self.weight[...][:, 0, :]

    @property
    def bias_or_none(self) -> jax.Array | None:
        return None if self.bias is None else self.bias[...]


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return norms.rms_norm(x, self.weight[...], self.eps)


class LayerNorm(nnx.Module):
    def __init__(self, size: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.bias = nnx.Param(jnp.zeros((size,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return norms.layer_norm(x, self.weight[...], self.bias[...], self.eps)


class GatedRMSNorm(nnx.Module):
    """Per-head output norm of GDN/KDA, its weight shared across heads (spec §2.5)."""

    def __init__(self, size: int, eps: float, activation: str, *, dtype):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.eps = eps
        self.activation = activation

    def __call__(self, o: jax.Array, gate: jax.Array) -> jax.Array:
        return norms.gated_rms_norm(o, gate, self.weight[...], self.eps, self.activation)


def make_norm(kind: str, size: int, eps: float, *, dtype) -> RMSNorm | LayerNorm:
    return LayerNorm(size, eps, dtype=dtype) if kind == "layer_norm" else RMSNorm(size, eps, dtype=dtype)


def conv_forward(
    conv: DepthwiseConv, x: jax.Array, state: jax.Array | None, op, lengths: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Run a conv through the dispatch point: one-token form when decoding from a state, else the sequence form.
    ``lengths`` (valid tokens per row) only matters for padded multi-token rows."""
    if state is not None and x.shape[1] == 1:
        y, state = op("causal_conv1d_step")(x[:, 0], conv.taps, conv.bias_or_none, state)
        return y[:, None], state
    return op("causal_conv1d")(x, conv.taps, conv.bias_or_none, state, lengths=lengths)


def conv_paged(conv: DepthwiseConv, x: jax.Array, conv_pool: jax.Array, batch, op) -> tuple[jax.Array, jax.Array]:
    """Engine conv over padded rows [S, T, C] whose state lives in the slot pool (updated in place): one-token
    rows use the decode form, longer rows the varlen form over the rows flattened into one token buffer."""
    rows, length = x.shape[:2]
    if length == 1:
        y, conv_pool = op("causal_conv1d_decode_slots")(
            x[:, 0], conv.taps, conv.bias_or_none, conv_pool, batch.slots, batch.fresh
        )
        return y[:, None], conv_pool
    starts, lengths = batch.varlen()
    y, conv_pool = op("causal_conv1d_varlen_slots")(
        x.reshape(rows * length, -1), conv.taps, conv.bias_or_none, conv_pool, starts, lengths, batch.slots,
        batch.fresh, max_len=length,
    )
    return y.reshape(rows, length, -1), conv_pool
