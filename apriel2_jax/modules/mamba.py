"""Apriel-H1 Mamba mixer (spec §2.8): Mamba-1 selective scan with ``d_xb`` grouped x/B and a low-rank dt."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import MambaConfig
from ..dispatch import op
from ..ops.slots import flatten_rows
from .layers import DepthwiseConv, Linear, conv_forward, conv_paged


class Mamba(nnx.Module):
    def __init__(self, cfg: MambaConfig, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        d_in, d_xb, n = cfg.d_inner, cfg.d_xb, cfg.state_size
        bias = cfg.add_linear_biases
        self.in_proj = Linear(hidden_size, 2 * d_in + 2 * d_xb, bias, dtype=dtype, rngs=rngs)
        self.dt_in_proj = Linear(hidden_size, cfg.dt_rank, bias, dtype=dtype, rngs=rngs)
        self.dt_proj = Linear(cfg.dt_rank, d_in, cfg.dt_proj_bias, dtype=dtype, rngs=rngs)
        self.conv1d = DepthwiseConv(cfg.conv_channels, cfg.d_conv, cfg.conv_bias, dtype=dtype, rngs=rngs)
        self.A_log = nnx.Param(jnp.log(jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.float32), (d_in, n))))
        self.D = nnx.Param(jnp.ones((d_in,), jnp.float32))
        self.out_proj = Linear(d_in, hidden_size, bias, dtype=dtype, rngs=rngs)

    @property
    def _groups(self) -> tuple[int, int]:
        """(number of x/B groups, heads per group)"""
        groups = self.cfg.d_xb // self.cfg.state_size
        return groups, self.cfg.d_inner // self.cfg.d_xb

    def init_state(self, batch: int, max_len: int, dtype) -> dict[str, jax.Array]:
        cfg = self.cfg
        return {
            "conv": jnp.zeros((batch, cfg.d_conv - 1, cfg.conv_channels), dtype),
            "ssm": jnp.zeros((batch, cfg.d_inner, cfg.state_size), jnp.float32),
        }

    def _repeat_groups(self, x: jax.Array) -> jax.Array:
        """[B, T, d_xb] -> [B, T, d_inner]: head h reads group h // rep (repeat_kv / repeat_interleave)."""
        groups, rep = self._groups
        batch, length, _ = x.shape
        x = x.reshape(batch, length, groups, self.cfg.state_size)
        return jnp.repeat(x, rep, axis=2).reshape(batch, length, self.cfg.d_inner)

    def _project(self, x: jax.Array):
        """Input projections: z [.., T, Din], pre-conv x [.., T, D_xb], B [.., T, groups, N], C [.., T, heads, N],
        delta [.., T, Din] and the scan's dt bias (None without dt_proj.bias)."""
        cfg = self.cfg
        batch, length, _ = x.shape
        d_in, d_xb, n = cfg.d_inner, cfg.d_xb, cfg.state_size
        groups, _ = self._groups
        zxbc = self.in_proj(x)
        z = zxbc[..., :d_in]
        xs = zxbc[..., d_in : d_in + d_xb]
        b = zxbc[..., d_in + d_xb : d_in + 2 * d_xb].reshape(batch, length, groups, n)
        c = zxbc[..., d_in + 2 * d_xb :].reshape(batch, length, d_in // n, n)
        delta = self.dt_proj(self.dt_in_proj(x))
        # QUIRK (spec §2.8): ``delta`` already contains dt_proj.bias and the scan adds it again, as the reference
        # (Apriel-H1, Fast-LLM) passes dt_proj.bias as the selective scan's delta_bias too.
        dt_bias = None if self.dt_proj.bias is None else self.dt_proj.bias[...]
        return z, xs, b, c, delta, dt_bias

    def __call__(self, x: jax.Array, positions: jax.Array, state: dict | None, token_mask: jax.Array | None = None):
        """token_mask: [B, T], False for right-padding tokens, which leave both states untouched."""
        cfg = self.cfg
        batch, length, _ = x.shape
        d_in, n = cfg.d_inner, cfg.state_size
        z, xs, b, c, delta, dt_bias = self._project(x)
        conv_state = None if state is None else state["conv"]
        lengths = None if token_mask is None else jnp.sum(token_mask, axis=1)
        if cfg.repeat_kv_before_conv:
            u, conv_state = conv_forward(self.conv1d, self._repeat_groups(xs), conv_state, op, lengths)
        else:
            u, conv_state = conv_forward(self.conv1d, xs, conv_state, op, lengths)
            u = self._repeat_groups(u)
        ssm = jnp.zeros((batch, d_in, n), jnp.float32) if state is None else state["ssm"]
        args = (self.A_log[...],)
        if state is not None and length == 1:
            y, ssm = op("selective_scan_step")(
                u[:, 0], delta[:, 0], *args, b[:, 0], c[:, 0], self.D[...], z[:, 0], dt_bias, ssm
            )
            y = y[:, None]
        else:
            y, ssm = op("selective_scan")(u, delta, *args, b, c, self.D[...], z, dt_bias, ssm, mask=token_mask)
        return self.out_proj(y), {"conv": conv_state, "ssm": ssm}

    def _conv_then_repeat(self, xs: jax.Array, run_conv) -> tuple[jax.Array, jax.Array]:
        """[R, T, D_xb] pre-conv x -> [R, T, Din] scan input u, the conv on either side of the group repeat."""
        if self.cfg.repeat_kv_before_conv:
            return run_conv(self._repeat_groups(xs))
        u, conv_pool = run_conv(xs)
        return self._repeat_groups(u), conv_pool

    def paged_decode(self, x: jax.Array, batch, pool: dict):
        """Engine decode, one token per row [S, 1, d]: both states are read from and written to the slot pool by
        ``batch.slots`` in place (Pallas kernels on GPU), so no state rows are gathered or scattered here."""
        z, xs, b, c, delta, dt_bias = self._project(x)
        u, conv_pool = self._conv_then_repeat(xs, lambda v: conv_paged(self.conv1d, v, pool["conv"], batch, op))
        y, ssm = op("selective_scan_decode_slots")(
            u[:, 0], delta[:, 0], self.A_log[...], b[:, 0], c[:, 0], self.D[...], z[:, 0], dt_bias,
            pool["ssm"], batch.slots, batch.fresh,
        )
        return self.out_proj(y[:, None]), {"conv": conv_pool, "ssm": ssm}

    def paged_prefill(self, x: jax.Array, batch, pool: dict):
        """Engine prefill over padded rows [S, T, d]: the rows are flattened into one token buffer (row s =
        tokens s*T .. s*T+len_s-1, len_s = its valid tokens) and the varlen slot-pool ops read and write both
        states in place. Padding tokens produce zeros and leave the states untouched; empty rows (padding rows,
        sink slot) leave their slot as it was."""
        rows, length, _ = x.shape
        z, xs, b, c, delta, dt_bias = self._project(x)
        u, conv_pool = self._conv_then_repeat(xs, lambda v: conv_paged(self.conv1d, v, pool["conv"], batch, op))
        starts, lengths = batch.varlen()
        y, ssm = op("selective_scan_varlen_slots")(
            flatten_rows(u), flatten_rows(delta), self.A_log[...], flatten_rows(b), flatten_rows(c), self.D[...],
            flatten_rows(z), dt_bias, pool["ssm"], starts, lengths, batch.slots, batch.fresh, max_len=length,
        )
        return self.out_proj(y.reshape(rows, length, -1)), {"conv": conv_pool, "ssm": ssm}
