"""Decode-step chains that the GPU runs as single kernels (``pallas_kernels/decode_matmul.py``).

A decode step moves each weight once for a handful of rows, so its time is the kernels' launches and tails as much
as their bytes: an attention block ran ~18 kernels per layer (norm reduce, norm scale, three projections, RoPE,
two page writes, ...). These functions are the jnp statement of three chains the kernels fuse, built from the
same ops the modules use, so each kernel has an oracle with the modules' exact math:

- ``norm_qkv_rope_write``: input RMSNorm, the Q/K/V projections, RoPE on Q and K, and the K/V page writes;
- ``norm_gated_mlp``: post-attention RMSNorm and the gated MLP's gate/up projections with the activation product;
- ``matmul_add``: a projection whose output is added to the residual stream (attention output, MLP down).

Rows are sequences ([S, D], one token each). The modules use the fused forms only where a kernel is registered
(``dispatch.kernel``); elsewhere they run the unfused chain, which these functions reproduce exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .norms import activation, rms_norm
from .paged_attention import write_pages
from .rope import apply_rope


def _project(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``Linear`` without bias: weight in the checkpoint's [out, in] layout."""
    return jnp.einsum("...i,oi->...o", x, weight)


def norm_qkv_rope_write(
    x: jax.Array,
    norm_weight: jax.Array,
    eps: float,
    wq: jax.Array,
    wk: jax.Array,
    wv: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    slots: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x: [S, D] residual stream; wq: [H * hd, D]; wk, wv: [G * hd, D]; cos, sin: [S, hd] (``rope_cos_sin`` of
    the rows' positions); slots: [S] flat page slot of each row's token (``page_slots``; padding rows point into
    the sink page); k_pages, v_pages: [P, page_size, G, hd].

    Returns the rotated queries [S, H, hd] and the pages with each row's rotated key and its value written."""
    rows = x.shape[0]
    head_dim = cos.shape[-1]
    h = rms_norm(x, norm_weight, eps)
    q = _project(h, wq).reshape(rows, 1, -1, head_dim)
    k = _project(h, wk).reshape(rows, 1, -1, head_dim)
    v = _project(h, wv).reshape(rows, 1, -1, head_dim)
    q = apply_rope(q, cos[:, None], sin[:, None])
    k = apply_rope(k, cos[:, None], sin[:, None])
    k_pages = write_pages(k_pages, k, slots[:, None])
    v_pages = write_pages(v_pages, v, slots[:, None])
    return q[:, 0], k_pages, v_pages


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
