"""Rotary position embedding, ``mistral_1d``: half rotation (NeoX style), fp32 angles (spec §2.3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, head_size: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """positions: [...] integer. Returns cos, sin: [..., head_size] computed in fp32 and cast to ``dtype``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_size, 2, dtype=jnp.float32) / head_size))
    # Each frequency twice (the halves), in the constant rather than the angles: cos and sin are then two
    # elementwise maps of one [..., head_size] product, which XLA can run as one kernel (it does at 32 decode
    # rows; two concatenation kernels before).
    angles = positions.astype(jnp.float32)[..., None] * jnp.concatenate([inv_freq, inv_freq])
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, heads, D]; cos/sin: [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
