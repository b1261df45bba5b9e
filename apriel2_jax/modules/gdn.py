"""Gated DeltaNet mixer (spec §2.6) with the flat ``[Q | K | V | Z]`` / ``[b | a]`` projection layout."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import GDNConfig
from ..dispatch import kernel, op
from ..ops.delta_rule import gdn_gate, split_packed_qkv
from ..ops.norms import activation
from ..ops.slots import flatten_rows
from .layers import DepthwiseConv, GatedRMSNorm, Linear, RMSNorm, conv_forward, conv_paged, residual_projection


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: GDNConfig, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        key_size = cfg.key_heads * cfg.key_head_dim
        value_size = cfg.value_heads * cfg.value_head_dim
        self.in_proj_qkvz = Linear(hidden_size, 2 * key_size + 2 * value_size, False, dtype=dtype, rngs=rngs)
        self.in_proj_ba = Linear(hidden_size, 2 * cfg.value_heads, False, dtype=dtype, rngs=rngs)
        self.convolution = DepthwiseConv(cfg.conv_channels, cfg.conv_kernel_size, False, dtype=dtype, rngs=rngs)
        self.out_proj = Linear(value_size, hidden_size, False, dtype=dtype, rngs=rngs)
        # Gate parameters stay fp32 whatever the model dtype: the gates are computed in fp32 (spec §8).
        self.dt_bias = nnx.Param(jnp.ones((cfg.value_heads,), jnp.float32))
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, cfg.value_heads, dtype=jnp.float32)))
        self.norm = GatedRMSNorm(cfg.value_head_dim, cfg.norm_eps, "silu", dtype=dtype)

    def init_state(self, batch: int, max_len: int, dtype) -> dict[str, jax.Array]:
        cfg = self.cfg
        return {
            "conv": jnp.zeros((batch, cfg.conv_kernel_size - 1, cfg.conv_channels), dtype),
            "ssm": jnp.zeros((batch, cfg.value_heads, cfg.key_head_dim, cfg.value_head_dim), jnp.float32),
        }

    def _projections(self, x: jax.Array):
        """Input projections: (pre-conv q|k|v, z [B,T,H_v,d_v], gate inputs b and a [B,T,H_v])."""
        return self._unpack(self.in_proj_qkvz(x), self.in_proj_ba(x))

    def _unpack(self, qkvz: jax.Array, ba: jax.Array):
        """The two input projections' outputs [B, T, *] as (pre-conv q|k|v, z [B,T,H_v,d_v], b, a [B,T,H_v])."""
        cfg = self.cfg
        batch, length, _ = qkvz.shape
        qkv, z = qkvz[..., : cfg.conv_channels], qkvz[..., cfg.conv_channels :]
        b, a = ba[..., : cfg.value_heads], ba[..., cfg.value_heads :]
        return qkv, z.reshape(batch, length, cfg.value_heads, cfg.value_head_dim), b, a

    def _gates(self, b: jax.Array, a: jax.Array):
        """(beta, g) from the gate inputs."""
        beta = activation("sigmoid", b)  # model dtype, as the reference
        return beta, gdn_gate(a, self.A_log[...], self.dt_bias[...])

    def _project(self, x: jax.Array):
        """Input projections and gates: (pre-conv q|k|v, z [B,T,H_v,d_v], beta, g)."""
        qkv, z, b, a = self._projections(x)
        return qkv, z, *self._gates(b, a)

    def _split(self, mixed: jax.Array):
        cfg = self.cfg
        return split_packed_qkv(mixed, cfg.key_heads, cfg.key_head_dim, cfg.value_heads)

    def _output(self, o: jax.Array, z: jax.Array) -> jax.Array:
        batch, length = o.shape[:2]
        y = self.norm(o, z)
        return self.out_proj(y.reshape(batch, length, self.cfg.value_heads * self.cfg.value_head_dim))

    def __call__(self, x: jax.Array, positions: jax.Array, state: dict | None, token_mask: jax.Array | None = None):
        """token_mask: [B, T], False for right-padding tokens, which leave both states untouched."""
        cfg = self.cfg
        batch, length, _ = x.shape
        qkv, z, beta, g = self._project(x)
        lengths = None if token_mask is None else jnp.sum(token_mask, axis=1)
        mixed, conv_state = conv_forward(self.convolution, qkv, None if state is None else state["conv"], op, lengths)
        q, k, v = self._split(mixed)
        if token_mask is not None:  # g = 0, beta = 0: an identity update
            g = jnp.where(token_mask[..., None], g, 0.0)
            beta = jnp.where(token_mask[..., None], beta, jnp.zeros_like(beta))
        if state is None:
            ssm = jnp.zeros((batch, cfg.value_heads, cfg.key_head_dim, cfg.value_head_dim), jnp.float32)
        else:
            ssm = state["ssm"]
        if state is not None and length == 1:
            o, ssm = op("gated_delta_rule_step")(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], ssm)
            o = o[:, None]
        else:
            o, ssm = op("gated_delta_rule")(q, k, v, g, beta, ssm)
        return self._output(o, z), {"conv": conv_state, "ssm": ssm}

    def paged_decode(self, x: jax.Array, batch, pool: dict):
        """Engine decode, one token per row (x [S, 1, D], normalised): conv and recurrent states are updated in
        place in the slot pool (Pallas kernels on GPU)."""
        proj = jnp.concatenate([self.in_proj_qkvz(x[:, 0]), self.in_proj_ba(x[:, 0])], -1)
        y, pool = self._decode(proj, batch, pool)
        return self.out_proj(y)[:, None], pool

    def fused_decode(self, norm) -> Callable | None:
        """The fused input norm + input projections + conv (``ops.decode_fused.norm_projections_conv``: q|k|v|z
        and b|a side by side, q|k|v through the conv), or None where the chain must run unfused (no kernel on this
        backend, a LayerNorm, biases or a tensor-parallel sum in a projection)."""
        fused = kernel("norm_projections_conv")
        if fused is None or not isinstance(norm, RMSNorm):
            return None
        if any(p.bias is not None or p.reduce_axis is not None for p in (self.in_proj_qkvz, self.in_proj_ba)):
            return None
        return fused

    def paged_decode_residual(self, fused, x: jax.Array, norm: RMSNorm, batch, pool: dict):
        """Engine decode from the residual stream ``x`` [S, 1, D]: the input norm, both input projections and the
        conv in one kernel (at a few rows), the gated state update, then the output projection added to ``x``.
        Returns the new residual stream and the pool."""
        weights = (self.in_proj_qkvz.weight[...], self.in_proj_ba.weight[...])
        conv = self.convolution
        # pad_columns: the update reads proj at its columns' offsets, so a kernel's padding past b|a can stay
        proj, conv_pool = fused(x[:, 0], norm.weight[...], norm.eps, weights, conv.taps, conv.bias_or_none,
                                pool["conv"], batch.slots, batch.fresh, pad_columns=True)
        y, ssm = self._update(proj, proj, batch, pool["ssm"])  # the conv wrote q|k|v over their projections
        return residual_projection(self.out_proj, y, x), {"conv": conv_pool, "ssm": ssm}

    def _decode(self, proj: jax.Array, batch, pool: dict):
        """One token per row from the input projections' outputs side by side, proj [S, q|k|v|z|b|a]: the gated
        norm's output [S, H_v d_v] (the output projection's input) and the updated pool. The conv and the update
        read their inputs in place in ``proj`` (slices handed to a kernel would be copies)."""
        cfg = self.cfg
        rows = proj.shape[0]
        value_size = cfg.value_heads * cfg.value_head_dim
        ba_offset = cfg.conv_channels + value_size
        fused = kernel("gdn_decode_fused_slots")
        if fused is not None:  # conv, gates and the state update in one kernel
            ba = proj[:, ba_offset : ba_offset + 2 * cfg.value_heads]
            qkv, z, b, a = self._unpack(proj[:, :ba_offset][:, None], ba[:, None])
            o, conv, ssm = fused(
                qkv[:, 0], self.convolution.taps, pool["conv"], a[:, 0], b[:, 0], self.A_log[...],
                self.dt_bias[...], pool["ssm"], batch.slots, batch.fresh, key_heads=cfg.key_heads,
            )
            y = self.norm(o, z[:, 0])
        else:
            mixed, conv = op("causal_conv1d_decode_slots")(
                proj, self.convolution.taps, self.convolution.bias_or_none, pool["conv"], batch.slots, batch.fresh,
                x_offset=0,
            )
            y, ssm = self._update(mixed, proj, batch, pool["ssm"])
        return y.reshape(rows, value_size), {"conv": conv, "ssm": ssm}

    def _update(self, mixed: jax.Array, proj: jax.Array, batch, ssm: jax.Array):
        """The gated state update and output norm from the conv's output ``mixed`` [S, q|k|v, ...] and the input
        projections' ``proj`` [S, q|k|v|z|b|a] (z, b and a read in place): [S, H_v d_v] and the state pool."""
        cfg = self.cfg
        value_size = cfg.value_heads * cfg.value_head_dim
        y, ssm = op("gdn_decode_gated_slots")(
            mixed, proj, self.A_log[...], self.dt_bias[...], self.norm.weight[...], ssm, batch.slots, batch.fresh,
            key_heads=cfg.key_heads, key_dim=cfg.key_head_dim, z_offset=cfg.conv_channels,
            ba_offset=cfg.conv_channels + value_size, eps=self.norm.eps,
        )
        return y.reshape(proj.shape[0], value_size), ssm

    def paged_prefill(self, x: jax.Array, batch, pool: dict):
        """Engine prefill over padded rows [S, T]: the rows become one packed token buffer, and the varlen ops
        read each row's states from its slot and write them back in place. Padding tokens leave them untouched."""
        length = x.shape[1]
        qkv, z, beta, g = self._project(x)
        mixed, conv = conv_paged(self.convolution, qkv, pool["conv"], batch, op)
        q, k, v = self._split(mixed)
        starts, lengths = batch.varlen()
        o, ssm = op("delta_rule_varlen_slots")(
            flatten_rows(q), flatten_rows(k), flatten_rows(v), flatten_rows(g), flatten_rows(beta), pool["ssm"],
            starts, lengths, batch.slots, batch.fresh, max_len=length,
        )
        return self._output(o.reshape(v.shape), z), {"conv": conv, "ssm": ssm}
