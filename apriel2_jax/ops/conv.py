"""Causal depthwise conv1d with an explicit state of the last K-1 inputs (spec §2.4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .norms import F32, activation as _activation


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    state: jax.Array | None,
    activation: str | None = "silu",
    lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Sequence form.

    x: [B, T, C] pre-conv inputs; weight: [C, K] (tap K-1 multiplies the current token); bias: [C] or None;
    state: [B, K-1, C], the K-1 inputs before x (zeros when None).
    lengths: [B] number of valid tokens per row (right padding); the new state then holds the K-1 inputs
    before each row's end, so padded tokens never enter it. None: all T tokens are valid.
    Returns y [B, T, C] in x's dtype (fp32 accumulation) and the new state, the last K-1 inputs, [B, K-1, C].
    """
    batch, length, channels = x.shape
    kernel = weight.shape[1]
    if state is None:
        state = jnp.zeros((batch, kernel - 1, channels), x.dtype)
    window = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    w32 = weight.astype(F32)
    acc = jnp.zeros((batch, length, channels), F32)
    for j in range(kernel):
        acc = acc + window[:, j : j + length].astype(F32) * w32[:, j]
    if bias is not None:
        acc = acc + bias.astype(F32)
    if activation is not None:
        acc = _activation(activation, acc)
    if lengths is None:
        return acc.astype(x.dtype), window[:, length:]
    take = jax.vmap(lambda w, n: jax.lax.dynamic_slice_in_dim(w, n, kernel - 1, axis=0))
    return acc.astype(x.dtype), take(window, lengths.astype(jnp.int32))


def causal_conv1d_step(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    state: jax.Array,
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:
    """One-token form. x: [B, C]; state: [B, K-1, C]. Returns y [B, C] and the shifted state."""
    window = jnp.concatenate([state.astype(x.dtype), x[:, None]], axis=1)  # [B, K, C]
    acc = jnp.einsum("bkc,ck->bc", window.astype(F32), weight.astype(F32), precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        acc = acc + bias.astype(F32)
    if activation is not None:
        acc = _activation(activation, acc)
    return acc.astype(x.dtype), window[:, 1:]
