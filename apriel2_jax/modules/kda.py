"""Kimi Delta Attention mixer (spec §2.7): three separate q/k/v convs, per-channel decay, low-rank gates."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import KDAConfig
from ..dispatch import kernel, op
from ..ops.delta_rule import kda_gate
from ..ops.slots import flatten_rows
from .layers import DepthwiseConv, GatedRMSNorm, Linear, RMSNorm, conv_forward, conv_paged, residual_projection


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
        g_raw, beta, gate = self._gate_inputs_from(self.f_a_proj(x), self.g_a_proj(x), self.beta_proj(x))
        return g_raw.reshape(shape), beta, gate.reshape(shape)

    def _gate_inputs_from(self, f_a: jax.Array, g_a: jax.Array, beta: jax.Array):
        """``_gate_inputs`` from the low-rank gates' first projections and the beta projection's output, flat
        over heads ([..., H D] and [..., H])."""
        beta = jax.nn.sigmoid(beta.astype(jnp.float32))
        return self.f_b_proj(f_a), beta, self.g_b_proj(g_a)

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

    def _input_projections(self) -> tuple[Linear, ...]:
        """Every projection of the mixer's input, in the order ``_decode`` takes their outputs side by side."""
        return (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj, self.beta_proj)

    def paged_decode(self, x: jax.Array, batch, pool: dict):
        """Engine decode, one token per row (x [S, 1, D], normalised): conv and recurrent states are updated in
        place in the slot pool (Pallas kernels on GPU)."""
        y, pool = self._decode(jnp.concatenate([p(x[:, 0]) for p in self._input_projections()], -1), batch, pool)
        return self.o_proj(y)[:, None], pool

    def fused_decode(self, norm) -> Callable | None:
        """The fused input norm + every input projection side by side (``ops.decode_fused.norm_projections``), or
        None where the chain must run unfused (no kernel on this backend, a LayerNorm,
        biases or a tensor-parallel sum in a projection)."""
        fused = kernel("norm_projections")
        if fused is None or not isinstance(norm, RMSNorm):
            return None
        if any(p.bias is not None or p.reduce_axis is not None for p in self._input_projections()):
            return None
        return fused

    def paged_decode_residual(self, fused, x: jax.Array, norm: RMSNorm, batch, pool: dict):
        """Engine decode from the residual stream ``x`` [S, 1, D]: the input norm and the six input projections in
        one kernel, the convs, gates and state update, then the output projection added to ``x``. Returns the new
        residual stream and the pool."""
        weights = tuple(proj.weight[...] for proj in self._input_projections())
        # pad_columns: _decode reads proj at its columns' offsets, so a kernel's padding past beta can stay
        y, pool = self._decode(fused(x[:, 0], norm.weight[...], norm.eps, weights, pad_columns=True), batch, pool)
        return residual_projection(self.o_proj, y, x), pool

    def _decode(self, proj: jax.Array, batch, pool: dict):
        """One token per row from the input projections' outputs side by side, proj [S, q|k|v|f_a|g_a|beta]
        (``_input_projections``): the gated norm's output [S, size] (the output projection's input) and the
        updated pool. The convs and the update (one kernel on the GPU) read their inputs in place in ``proj``
        (slices handed to a kernel would be copies)."""
        cfg = self.cfg
        size, dim = cfg.projection_size, cfg.head_dim
        f_a_offset, g_a_offset, beta_offset = 3 * size, 3 * size + dim, 3 * size + 2 * dim
        fused = kernel("kda_decode_fused_slots")
        if fused is not None:  # convs, gate and the state update in one kernel
            g_raw, beta, gate = self._gate_inputs_from(proj[:, f_a_offset:g_a_offset], proj[:, g_a_offset:beta_offset],
                                                       proj[:, beta_offset : beta_offset + cfg.heads])
            shape = (proj.shape[0], cfg.heads, dim)
            o, conv_pools, ssm = fused(
                proj[:, :size], proj[:, size : 2 * size], proj[:, 2 * size : 3 * size],
                (self.q_conv.taps, self.k_conv.taps, self.v_conv.taps),
                (pool["conv_q"], pool["conv_k"], pool["conv_v"]), g_raw.reshape(shape), beta, self.A_log[...],
                self.dt_bias[...], pool["ssm"], batch.slots, batch.fresh,
            )
            convs = dict(zip(("conv_q", "conv_k", "conv_v"), conv_pools))
            y = self.norm(o, gate.reshape(shape))
        else:
            conv_layers = (self.q_conv, self.k_conv, self.v_conv)
            y, conv_pools, ssm = op("kda_decode_conv_gated_slots")(
                proj, tuple(c.taps for c in conv_layers), tuple(c.bias_or_none for c in conv_layers),
                tuple(pool[f"conv_{n}"] for n in "qkv"), self.f_b_proj.weight[...], self.g_b_proj.weight[...],
                self.A_log[...], self.dt_bias[...], self.norm.weight[...], pool["ssm"], batch.slots, batch.fresh,
                f_a_offset=f_a_offset, g_a_offset=g_a_offset, beta_offset=beta_offset, eps=self.norm.eps,
                norm_activation=self.norm.activation,
            )
            convs = {f"conv_{n}": p for n, p in zip("qkv", conv_pools)}
        return y.reshape(proj.shape[0], size), dict(convs, ssm=ssm)

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
