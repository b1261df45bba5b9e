"""Decode-step chains that the GPU runs as single kernels (``pallas_kernels/decode_gemv.py``; the whole MLP in
``pallas_kernels/decode_mlp.py``, not registered by default).

A decode step reads each weight once for a handful of rows, so its time is the kernels' launches and tails as much
as their bytes: an attention layer ran 13 kernels at one row (two norms of two kernels each, separate Q/K/V
projections, the activation product, ...). These functions are the jnp statement of the chains the kernels
fuse, built from the same ops the modules use, so each kernel has an oracle with the modules' exact math:

- ``norm_projections``: an RMSNorm and several projections of its output side by side (attention's Q/K/V, as
  the fused decode attention kernel takes them in one buffer);
- ``norm_projections_conv``: the same with a depthwise causal conv on the first columns (GDN's q|k|v);
- ``norm_gated_mlp``: post-attention RMSNorm and the gated MLP's gate/up projections with the activation product;
- ``matmul_add``: a projection whose output is added to the residual stream (attention output, MLP down);
- ``gated_mlp_residual``: the whole gated MLP with its norm and residual add (``x + down(norm_gated_mlp(x))``).

Rows are sequences ([S, D], one token each). The modules use the fused forms only where a kernel is registered
(``dispatch.kernel``); elsewhere they run the unfused chain, which these functions reproduce exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .conv import causal_conv1d_decode_slots
from .norms import activation, rms_norm
from .precision import einsum


def _project(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``Linear`` without bias: weight in the checkpoint's [out, in] layout."""
    return einsum("...i,oi->...o", x, weight)


def norm_projections(x: jax.Array, norm_weight: jax.Array, eps: float, weights: tuple[jax.Array, ...],
                     pad_columns: bool = False) -> jax.Array:
    """x: [S, D] residual stream; weights: [N_i, D] each. The projections of ``rmsnorm(x)`` side by side:
    [S, sum N_i].

    pad_columns: the caller reads the result only at its first sum N_i columns, so an implementation may return
    more (a kernel's tile padding, holding anything) rather than copy its output to drop them. This reference
    returns exactly sum N_i."""
    del pad_columns
    h = rms_norm(x, norm_weight, eps)
    return jnp.concatenate([_project(h, w) for w in weights], axis=-1)


def norm_projections_conv(
    x: jax.Array, norm_weight: jax.Array, eps: float, weights: tuple[jax.Array, ...], conv_weight: jax.Array,
    conv_bias: jax.Array | None, conv_pool: jax.Array, slots: jax.Array, fresh: jax.Array, pad_columns: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``norm_projections`` whose first C output columns go through a depthwise causal conv (silu) against the
    rows' slots of ``conv_pool`` [P, Kc-1, C] (``causal_conv1d_decode_slots``; conv_weight [C, Kc]): GDN's
    q|k|v, from the norm to the conv's output with z, b and a raw beside it. A depthwise conv's channel needs only
    its own feature, so the kernel runs it on each projected tile. Returns [S, sum N_i] and the pool.
    ``pad_columns``: as in ``norm_projections``."""
    proj = norm_projections(x, norm_weight, eps, weights, pad_columns)
    mixed, conv_pool = causal_conv1d_decode_slots(proj, conv_weight, conv_bias, conv_pool, slots, fresh)
    return jnp.concatenate([mixed, proj[:, conv_weight.shape[0] :]], axis=-1), conv_pool


def norm_gated_mlp(
    x: jax.Array, norm_weight: jax.Array, eps: float, w_gate: jax.Array, w_up: jax.Array, act: str
) -> jax.Array:
    """x: [S, D]; w_gate, w_up: [I, D]. ``act(gate(rmsnorm(x))) * up(rmsnorm(x))``: [S, I], the input of the
    MLP's down projection."""
    h = rms_norm(x, norm_weight, eps)
    return activation(act, _project(h, w_gate)) * _project(h, w_up)


def matmul_add(x: jax.Array, weight: jax.Array, residual: jax.Array) -> jax.Array:
    """x: [S, K]; weight: [N, K]; residual: [S, N]. ``residual + x @ weight.T``, the projection rounded to the
    dtype before the add (as ``Linear`` then ``+``)."""
    return residual + _project(x, weight)


def gated_mlp_residual(
    x: jax.Array, norm_weight: jax.Array, eps: float, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
    act: str,
) -> jax.Array:
    """x: [S, D]; w_gate, w_up: [I, D]; w_down: [D, I]. ``x + down(act(gate(rmsnorm(x))) * up(rmsnorm(x)))``: the
    residual stream after the block's MLP."""
    return matmul_add(norm_gated_mlp(x, norm_weight, eps, w_gate, w_up, act), w_down, x)
