"""The kernels behind the plain sequence and one-token ops (``gated_delta_rule``, ``selective_scan``, ...), which
the non-engine paths use (``ModelRunner``, golden parity): a batch of rows [B, T] is a packed buffer of B
sequences of T tokens, and the per-row states are a pool of B slots. Right-padding tokens (masked as the
modules do it: identity updates) need no special handling; the kernels give zeros where the references give
values that are never used."""

from __future__ import annotations

import jax.numpy as jnp

from apriel2_jax.ops.slots import flatten_rows

from . import causal_conv1d, delta_rule_decode, delta_rule_prefill, selective_scan


def _own(x, dtype):
    """A private copy: the kernels donate their state arguments, and the caller keeps its array (under an
    enclosing jit the copy is free to be elided; called eagerly, it is what keeps the caller's state alive)."""
    return jnp.array(x, dtype, copy=True)


def _rows(batch: int, length: int):
    slots = jnp.arange(batch, dtype=jnp.int32)
    return slots * length, slots, jnp.zeros((batch,), bool)


def _delta_rule(q, k, v, g, beta, initial_state, chunk_size=64):
    del chunk_size  # the kernels use their own
    batch, length = v.shape[:2]
    starts, slots, fresh = _rows(batch, length)
    lengths = jnp.full((batch,), length, jnp.int32)
    o, state = delta_rule_prefill.prefill_slots(
        *map(flatten_rows, (q, k, v, g, beta)), _own(initial_state, jnp.float32), starts, lengths, slots, fresh,
        max_len=length)
    return o.reshape(v.shape), state


def _delta_rule_step(q, k, v, g, beta, state):
    _, slots, fresh = _rows(v.shape[0], 1)
    return delta_rule_decode.decode_slots(q, k, v, g, beta, _own(state, jnp.float32), slots, fresh)


def gated_delta_rule(q, k, v, g, beta, initial_state, chunk_size=64):
    return _delta_rule(q, k, v, g, beta, initial_state, chunk_size)


def kda_delta_rule(q, k, v, g, beta, initial_state, chunk_size=16):
    return _delta_rule(q, k, v, g, beta, initial_state, chunk_size)


gated_delta_rule_step = _delta_rule_step
kda_delta_rule_step = _delta_rule_step


def selective_scan_seq(u, delta, A_log, B, C, D, z, dt_bias, initial_state, chunk_size=32, mask=None):
    del chunk_size
    batch, length = u.shape[:2]
    starts, slots, fresh = _rows(batch, length)
    lengths = jnp.full((batch,), length, jnp.int32) if mask is None else jnp.sum(mask, axis=1).astype(jnp.int32)
    y, state = selective_scan.varlen_slots(
        flatten_rows(u), flatten_rows(delta), A_log, flatten_rows(B), flatten_rows(C), D, flatten_rows(z), dt_bias,
        _own(initial_state, jnp.float32), starts, lengths, slots, fresh, max_len=length)
    return y.reshape(u.shape), state


def selective_scan_step(u, delta, A_log, B, C, D, z, dt_bias, state):
    _, slots, fresh = _rows(u.shape[0], 1)
    return selective_scan.decode_slots(u, delta, A_log, B, C, D, z, dt_bias, _own(state, jnp.float32),
                                       slots, fresh)


def causal_conv1d_seq(x, weight, bias, state, activation="silu", lengths=None):
    batch, length, channels = x.shape
    starts, slots, fresh = _rows(batch, length)
    if state is None:
        state = jnp.zeros((batch, weight.shape[1] - 1, channels), x.dtype)
    lengths = jnp.full((batch,), length, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    y, state = causal_conv1d.varlen_slots(flatten_rows(x), weight, bias, _own(state, x.dtype), starts, lengths, slots,
                                          fresh, max_len=length, activation=activation)
    return y.reshape(x.shape), state


def causal_conv1d_step(x, weight, bias, state, activation="silu"):
    _, slots, fresh = _rows(x.shape[0], 1)
    return causal_conv1d.decode_slots(x, weight, bias, _own(state, x.dtype), slots, fresh, activation)
