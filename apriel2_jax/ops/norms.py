"""Normalisations (spec §2.1, §2.5) and the shared activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def softplus(x: jax.Array) -> jax.Array:
    """``torch.nn.functional.softplus`` with its default threshold 20 (``x`` itself above it)."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _tanh_gelu(x: jax.Array) -> jax.Array:
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


# transformers' ``ACT2FN`` (``transformers/activations.py``) without the activations that take parameters; the
# MLP's ``activation`` may be any of them (spec §1.3; ``config._ACTIVATIONS`` lists the same names).
_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_python": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_10": lambda x: jnp.clip(jax.nn.gelu(x, approximate=False), -10.0, 10.0),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_python_tanh": _tanh_gelu,
    "gelu_new": _tanh_gelu,
    "gelu_accurate": _tanh_gelu,
    "gelu_fast": lambda x: 0.5 * x * (1.0 + jnp.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "laplace": lambda x: 0.5 * (1.0 + jax.lax.erf((x - 0.707107) / (0.282095 * 1.4142135623730951))),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    "relu6": jax.nn.relu6,
    "hardswish": jax.nn.hard_swish,
    "sqrtsoftplus": lambda x: jnp.sqrt(softplus(x)),
    "leaky_relu": lambda x: jax.nn.leaky_relu(x, 0.01),
    "mish": lambda x: x * jnp.tanh(softplus(x)),
    "linear": lambda x: x,
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
