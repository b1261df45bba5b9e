"""Causal depthwise conv1d with an explicit state of the last K-1 inputs (spec §2.4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .norms import F32, activation as _activation
from .slots import slot_rows, varlen_rows


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


def causal_conv1d_varlen_slots(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    starts: jax.Array,
    lengths: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    *,
    max_len: int,
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:
    """Varlen form over the engine's state-slot pool (the oracle of the Pallas kernel).

    x: [N_tokens, C] flat buffer, sequence s = tokens starts[s] .. starts[s]+lengths[s]-1 (lengths may be 0);
    conv_pool: [N_slots, K-1, C]; slots: [S] pool row of each sequence; fresh: [S] bool, start from zeros instead
    of the pool row; max_len: static bound on lengths (longer sequences would be truncated).
    Returns y [N_tokens, C] (zeros at tokens no sequence covers) and the pool, rows ``slots`` of sequences with
    lengths > 0 replaced by the last K-1 inputs before each sequence's end (older state inputs included when a
    sequence is shorter than K-1); rows of empty sequences are left untouched.
    """
    n_tokens = x.shape[0]
    gather, scatter, _ = varlen_rows(starts, lengths, max_len, n_tokens)
    state = slot_rows(conv_pool, slots, fresh)
    y, new = causal_conv1d(x[gather], weight, bias, state, activation, lengths=lengths)
    y_flat = jnp.zeros_like(x).at[scatter].set(y, mode="drop")
    rows = jnp.where(lengths > 0, slots, conv_pool.shape[0])
    return y_flat, conv_pool.at[rows].set(new.astype(conv_pool.dtype), mode="drop")


def causal_conv1d_decode_slots(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    activation: str | None = "silu",
    *,
    x_offset: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """One token per row against the slot pool. x: [S, C], or a wider buffer whose columns [x_offset, x_offset + C)
    are the input (a projection's output read in place; C is the weight's); conv_pool: [N_slots, K-1, C]. Every
    row writes its slot (padding rows write the sink slot 0). Returns y [S, C] and the pool."""
    channels = weight.shape[0]
    if x.ndim != 2 or not 0 <= x_offset <= x.shape[1] - channels:
        raise ValueError(f"conv input must be [S, >= {x_offset} + {channels}] (x_offset + the weight's channels), "
                         f"got {list(x.shape)}")
    x = x[:, x_offset : x_offset + channels]
    y, rows = causal_conv1d_step(x, weight, bias, slot_rows(conv_pool, slots, fresh), activation)
    return y, conv_pool.at[slots].set(rows.astype(conv_pool.dtype))
