"""Kimi Delta Attention mixer (spec §2.7): three separate q/k/v convs, per-channel decay, low-rank gates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import KDAConfig
from ..dispatch import kernel, op
from ..ops.delta_rule import kda_gate
from ..ops.slots import flatten_rows
from .layers import DepthwiseConv, GatedRMSNorm, Linear, conv_forward, conv_paged


class KimiDeltaAttention(nnx.Module):
    def __init__(self, cfg: KDAConfig, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        size, dim = cfg.projection_size, cfg.head_dim
        self.q_proj = Linear(hidden_size, size, False, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(hidden_size, size, False, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(hidden_size, size, False, dtype=dtype, rngs=rngs)
        self.q_conv = DepthwiseConv(size, cfg.conv_kernel_size, False, dtype=dtype, rngs=rngs)
        self.k_conv = DepthwiseConv(size, cfg.conv_kernel_size, False, dtype=dtype, rngs=rngs)
        self.v_conv = DepthwiseConv(size, cfg.conv_kernel_size, False, dtype=dtype, rngs=rngs)
        self.f_a_proj = Linear(hidden_size, dim, False, dtype=dtype, rngs=rngs)
        self.f_b_proj = Linear(dim, size, False, dtype=dtype, rngs=rngs)
        self.g_a_proj = Linear(hidden_size, dim, False, dtype=dtype, rngs=rngs)
        self.g_b_proj = Linear(dim, size, False, dtype=dtype, rngs=rngs)
        self.beta_proj = Linear(hidden_size, cfg.heads, False, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(size, hidden_size, False, dtype=dtype, rngs=rngs)
        # Created fp32 in the reference and kept so: the decay gate is computed in fp32.
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, cfg.heads, dtype=jnp.float32)))
        self.dt_bias = nnx.Param(jnp.zeros((size,), jnp.float32))
        self.norm = GatedRMSNorm(dim, cfg.norm_eps, cfg.norm_activation, dtype=dtype)

    def init_state(self, batch: int, max_len: int, dtype) -> dict[str, jax.Array]:
        cfg = self.cfg
        conv = (batch, cfg.conv_kernel_size - 1, cfg.projection_size)
        return {
            "conv_q": jnp.zeros(conv, dtype),
            "conv_k": jnp.zeros(conv, dtype),
            "conv_v": jnp.zeros(conv, dtype),
            "ssm": jnp.zeros((batch, cfg.heads, cfg.head_dim, cfg.head_dim), jnp.float32),
        }

    def _gate_inputs(self, x: jax.Array):
        """(decay gate input g_raw [B,T,H,D], beta [B,T,H] fp32, output gate [B,T,H,D])."""
        cfg = self.cfg
        shape = x.shape[:2] + (cfg.heads, cfg.head_dim)
        beta = jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32))
        return self.f_b_proj(self.f_a_proj(x)).reshape(shape), beta, self.g_b_proj(self.g_a_proj(x)).reshape(shape)

    def _gates(self, x: jax.Array):
        """(g [B,T,H,D] fp32 log decay, beta [B,T,H] fp32, output gate [B,T,H,D])."""
        g_raw, beta, gate = self._gate_inputs(x)
        return kda_gate(g_raw, self.A_log[...], self.dt_bias[...]), beta, gate

    def _convs(self, x: jax.Array, get, lengths=None):
        cfg = self.cfg
        shape = x.shape[:2] + (cfg.heads, cfg.head_dim)
        q, conv_q = conv_forward(self.q_conv, self.q_proj(x), get("conv_q"), op, lengths)
        k, conv_k = conv_forward(self.k_conv, self.k_proj(x), get("conv_k"), op, lengths)
        v, conv_v = conv_forward(self.v_conv, self.v_proj(x), get("conv_v"), op, lengths)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape), {"conv_q": conv_q, "conv_k": conv_k, "conv_v": conv_v}

    def _output(self, o: jax.Array, gate: jax.Array) -> jax.Array:
        batch, length = o.shape[:2]
        return self.o_proj(self.norm(o, gate).reshape(batch, length, self.cfg.projection_size))

    def __call__(self, x: jax.Array, positions: jax.Array, state: dict | None, token_mask: jax.Array | None = None):
        """token_mask: [B, T], False for right-padding tokens, which leave all states untouched."""
        cfg = self.cfg
        batch, length, _ = x.shape
        get = (lambda key: None) if state is None else state.get
        lengths = None if token_mask is None else jnp.sum(token_mask, axis=1)
        q, k, v, convs = self._convs(x, get, lengths)
        g, beta, gate = self._gates(x)
        if token_mask is not None:  # g = 0, beta = 0: an identity update
            g = jnp.where(token_mask[..., None, None], g, 0.0)
            beta = jnp.where(token_mask[..., None], beta, 0.0)
        ssm = get("ssm")
        if ssm is None:
            ssm = jnp.zeros((batch, cfg.heads, cfg.head_dim, cfg.head_dim), jnp.float32)
        if state is not None and length == 1:
            o, ssm = op("kda_delta_rule_step")(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], ssm)
            o = o[:, None]
        else:
            o, ssm = op("kda_delta_rule")(q, k, v, g, beta, ssm)
        return self._output(o, gate), dict(convs, ssm=ssm)

    def _convs_paged(self, x: jax.Array, batch, pool: dict):
        cfg = self.cfg
        shape = x.shape[:2] + (cfg.heads, cfg.head_dim)
        out, convs = [], {}
        for name, proj, conv in (("q", self.q_proj, self.q_conv), ("k", self.k_proj, self.k_conv),
                                 ("v", self.v_proj, self.v_conv)):
            y, convs[f"conv_{name}"] = conv_paged(conv, proj(x), pool[f"conv_{name}"], batch, op)
            out.append(y.reshape(shape))
        return (*out, convs)

    def paged_decode(self, x: jax.Array, batch, pool: dict):
        """Engine decode, one token per row: conv and recurrent states are updated in place in the slot pool
        (Pallas kernels on GPU)."""
        fused = kernel("kda_decode_fused_slots")
        if fused is not None:  # convs, gate and the state update in one kernel
            return self._paged_decode_fused(fused, x, batch, pool)
        q, k, v, convs = self._convs_paged(x, batch, pool)
        g, beta, gate = self._gates(x)
        o, ssm = op("delta_rule_decode_slots")(
            q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pool["ssm"], batch.slots, batch.fresh
        )
        return self._output(o[:, None], gate), dict(convs, ssm=ssm)

    def _paged_decode_fused(self, fused, x: jax.Array, batch, pool: dict):
        g_raw, beta, gate = self._gate_inputs(x)
        o, conv_pools, ssm = fused(
            self.q_proj(x)[:, 0], self.k_proj(x)[:, 0], self.v_proj(x)[:, 0],
            (self.q_conv.taps, self.k_conv.taps, self.v_conv.taps),
            (pool["conv_q"], pool["conv_k"], pool["conv_v"]), g_raw[:, 0], beta[:, 0], self.A_log[...],
            self.dt_bias[...], pool["ssm"], batch.slots, batch.fresh,
        )
        convs = dict(zip(("conv_q", "conv_k", "conv_v"), conv_pools))
        return self._output(o[:, None], gate), dict(convs, ssm=ssm)

    def paged_prefill(self, x: jax.Array, batch, pool: dict):
        """Engine prefill over padded rows [S, T], packed into one token buffer for the varlen slot-pool ops."""
        length = x.shape[1]
        q, k, v, convs = self._convs_paged(x, batch, pool)
        g, beta, gate = self._gates(x)
        starts, lengths = batch.varlen()
        o, ssm = op("delta_rule_varlen_slots")(
            flatten_rows(q), flatten_rows(k), flatten_rows(v), flatten_rows(g), flatten_rows(beta), pool["ssm"],
            starts, lengths, batch.slots, batch.fresh, max_len=length,
        )
        return self._output(o.reshape(v.shape), gate), dict(convs, ssm=ssm)
