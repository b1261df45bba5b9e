"""Normalisations (spec §2.1, §2.5) and the shared activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def softplus(x: jax.Array) -> jax.Array:
    """``torch.nn.functional.softplus`` with its default threshold 20 (``x`` itself above it)."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def activation(name: str, x: jax.Array) -> jax.Array:
    """The activation in fp32, rounded once to ``x``'s dtype, as torch's elementwise kernels compute bf16/fp16.
    ``jax.nn.sigmoid`` on bf16 rounds after each of its ops and differs from torch in about 30% of values."""
    fn = _ACTIVATIONS.get(name)
    if fn is None:
        raise ValueError(f"unsupported activation {name!r}; expected one of {sorted(_ACTIVATIONS)}")
    return fn(x.astype(F32)).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Block/final RMSNorm: normalise in fp32, cast back, *then* multiply by the weight (as HF MistralRMSNorm)."""
    x32 = x.astype(F32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(F32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * weight.astype(F32) + bias.astype(F32)
    return y.astype(x.dtype)


def gated_rms_norm(o: jax.Array, gate: jax.Array, weight: jax.Array, eps: float, act: str = "silu") -> jax.Array:
    """GDN/KDA output norm: ``w * rmsnorm(o) * act(gate)`` over the last axis, entirely in fp32 (spec §2.5)."""
    o32 = o.astype(F32)
    normed = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    return (weight.astype(F32) * normed * activation(act, gate.astype(F32))).astype(o.dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(|x|^2 + eps)`` over the last axis in fp32 (fla's in-kernel q/k norm)."""
    x32 = x.astype(F32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)
