"""Decode-step projections fused with their neighbours, in Pallas (Triton backend): the kernels of the chains in
``apriel2_jax.ops.decode_fused`` (the jnp oracle, same signatures).

Why. A decode step reads every weight once for a few rows. On an H200 the 0.5B geometry's attention block ran
~18 kernels per layer of 1-7 µs each (norm reduce and scale, three projections, RoPE, page writes, activation,
residual adds): launches and tails, not bytes, set the step time. Here a layer's dense work is four kernels:

- ``norm_qkv_rope_write``: RMSNorm of the residual stream, the Q/K/V projections, RoPE on Q and K, and K/V stored
  straight into their page slots;
- ``norm_gated_mlp``: RMSNorm, the gate and up projections and ``act(gate) * up``;
- ``matmul_add`` (twice): the attention output and MLP down projections, each added to the residual stream.

Design. One program per tile of output features (weight rows, [out, in] checkpoint layout, so each weight row is
contiguous): it walks the input dimension in blocks of ``block_k`` and accumulates ``x_block @ w_block.T`` in fp32
on the tensor cores. All rows of the step are one tile of M = max(16, next power of two) rows (the dot's minimum;
rows past the step's are masked, load zeros and are never stored), so the weights are read exactly once per step
whatever the batch. Tiles of 16 output features give hundreds of programs at the 0.5B geometry (4864 / 16 for the
MLP), enough to keep every SM streaming weights.

- The RMSNorm is a prologue: each program first sums the squares of its rows (the rows are a few KB, read from
  L2 by every program), then normalises each input block as it loads it, with the reference's roundings (fp32
  normalisation, cast to the dtype, times the weight in the dtype). The normalised activations never go to HBM.
- RoPE pairs feature ``i`` with ``i + head_dim / 2``: a Q/K program owns 16 features of the first half of one head
  and the 16 matching features of the second half, and rotates the two accumulators against each other in fp32.
  K and V programs then store their features into the pages at each row's slot (the pool viewed as token rows
  [P * page_size, G * hd], updated in place through ``input_output_aliases``).
- Outputs are rounded to the dtype where the reference's ops round: the projection, then the activation product
  or the residual add.

fp32 inputs use IEEE dots (precision HIGHEST), so the kernels match the fp32 oracle to rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from apriel2_jax.ops import decode_fused as reference
from apriel2_jax.ops.norms import _ACTIVATIONS

from .paged_attention_decode import _next_power_of_two

F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TILE = 16  # output features per program (per RoPE half for Q/K): the dot's minimum N
_MAX_ROWS = 128  # rows of one step the kernels take as one tile (decode buckets stay below)


def _block_k(k_dim: int, block_k: int | None) -> tuple[int, bool]:
    """(block, masked): by default the largest power-of-two block <= 256 dividing the input width (unmasked
    loads), else 256 with the tail masked."""
    if block_k is not None:
        if block_k < 16 or block_k & (block_k - 1):
            raise ValueError(f"block_k={block_k} must be a power of two >= 16 (Triton blocks, dot sizes)")
        return block_k, k_dim % block_k != 0
    for block in (256, 128, 64):
        if k_dim % block == 0:
            return block, False
    return 256, True


def _config(x, block_k: int | None, block_n: int = _TILE) -> dict:
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two >= 16 (the dot's minimum)")
    rows, k_dim = x.shape
    block_k, masked = _block_k(k_dim, block_k)
    fp32 = x.dtype == jnp.float32
    return dict(
        rows=rows, rows_p=max(16, _next_power_of_two(rows)), k_dim=k_dim, block_k=block_k, masked=masked,
        block_n=block_n, precision=jax.lax.Precision.HIGHEST if fp32 else None, dtype=x.dtype,
    )


def _common_reason(x, weights) -> str | None:
    if x.ndim != 2:
        return "x must be [rows, features]"
    if jnp.dtype(x.dtype) not in _DTYPES or any(w.dtype != x.dtype for w in weights):
        return f"dtypes must be one of f32/bf16/f16 and equal (x {x.dtype}, weights {[str(w.dtype) for w in weights]})"
    if x.shape[0] > _MAX_ROWS:
        return f"at most {_MAX_ROWS} rows (got {x.shape[0]})"
    if any(w.ndim != 2 or w.shape[1] != x.shape[1] for w in weights):
        return f"weights must be [out, {x.shape[1]}], got {[w.shape for w in weights]}"
    return None


def _row_index(rows: int, rows_p: int):
    r = jnp.arange(rows_p, dtype=jnp.int32)
    return jnp.minimum(r, rows - 1), r < rows  # in-bounds addresses, and which rows are real


def _x_block(x_ref, i, *, rows, rows_p, k_dim, block_k, masked, **_):
    """Input block ``i`` of every row: ([rows_p, block_k] with zeros past the real rows and the input width,
    its columns, which columns are inside the width)."""
    x_rows, row_ok = _row_index(rows, rows_p)
    cols = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
    col_ok = cols < k_dim
    mask = row_ok[:, None] & col_ok[None, :] if masked else row_ok[:, None]
    return pltriton.load(x_ref.at[x_rows[:, None], cols[None, :]], mask=mask, other=0), cols, col_ok


def _norm_scale(x_ref, eps, **cfg):
    """rsqrt(mean(x^2) + eps) per row in fp32, [rows_p]."""
    rows_p, k_dim, block_k = cfg["rows_p"], cfg["k_dim"], cfg["block_k"]

    def body(i, ss):
        x = _x_block(x_ref, i, **cfg)[0].astype(F32)
        return ss + jnp.sum(x * x, axis=1)

    ss = jax.lax.fori_loop(0, pl.cdiv(k_dim, block_k), body, jnp.zeros((rows_p,), F32))
    return jax.lax.rsqrt(ss / k_dim + eps)


def _project(x_ref, tiles, *, norm=None, **cfg):
    """fp32 accumulators [rows_p, len(w_rows)], one per ``(w_ref, w_rows)`` of ``tiles``: the rows' activations
    (RMS-normalised when ``norm = (scale, norm_ref)``) times those weight rows, transposed."""
    rows_p, k_dim, block_k, masked = cfg["rows_p"], cfg["k_dim"], cfg["block_k"], cfg["masked"]
    precision, dtype = cfg["precision"], cfg["dtype"]

    def body(i, accs):
        x, cols, col_ok = _x_block(x_ref, i, **cfg)
        if norm is not None:
            scale, norm_ref = norm
            if masked:
                weight = pltriton.load(norm_ref.at[cols], mask=col_ok, other=0)
            else:
                weight = norm_ref[pl.ds(i * block_k, block_k)]
            normed = (x.astype(F32) * scale[:, None]).astype(dtype)
            x = (weight.astype(F32)[None, :] * normed.astype(F32)).astype(dtype)
        out = []
        for (w_ref, w_rows), acc in zip(tiles, accs):
            if masked:
                w = pltriton.load(w_ref.at[w_rows[:, None], cols[None, :]], mask=col_ok[None, :], other=0)
            else:
                w = w_ref[w_rows[:, None], cols[None, :]]
            out.append(acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                                                 preferred_element_type=F32))
        return tuple(out)

    init = tuple(jnp.zeros((rows_p, w_rows.shape[0]), F32) for _, w_rows in tiles)
    return jax.lax.fori_loop(0, pl.cdiv(k_dim, block_k), body, init)


def _store_tile(o_ref, value, *, feats, n_dim, interpret, rows, rows_p, **_):
    """Store a [rows_p, block_n] output tile at ``o_ref[rows, feats]`` for the real rows and features. On the GPU
    masked lanes are never written (their addresses are clamped in bounds). The interpreter instead writes old
    contents back at masked lanes in one scatter, where a duplicate of a real address could win, so there the
    output has spare rows and columns (see ``_feature_tiled_call``) and masked lanes address those."""
    r = jnp.arange(rows_p, dtype=jnp.int32)
    row_ok = r < rows
    ok = row_ok[:, None] & (feats < n_dim)[None, :]
    if interpret:
        target_rows, target_feats = jnp.where(row_ok, r, rows + r), feats
    else:
        target_rows, target_feats = jnp.minimum(r, rows - 1), jnp.minimum(feats, n_dim - 1)
    pltriton.store(o_ref.at[target_rows[:, None], target_feats[None, :]], value.astype(o_ref.dtype), mask=ok)


def _features(cfg: dict, n_dim: int):
    """This program's output features, and the same clamped inside ``n_dim`` (addresses for loads)."""
    feats = pl.program_id(0) * cfg["block_n"] + jnp.arange(cfg["block_n"], dtype=jnp.int32)
    return feats, jnp.minimum(feats, n_dim - 1)


def _feature_tiled_call(kernel, inputs, *, x, n_dim, cfg, name, num_warps, num_stages, interpret):
    """One program per ``block_n`` output features of an [S, n_dim] output in x's dtype (the interpreter's
    output has the spare rows and columns ``_store_tile`` writes masked lanes to, cut off here)."""
    rows = x.shape[0]
    shape = (rows, n_dim)
    if interpret:
        shape = (rows + cfg["rows_p"], pl.cdiv(n_dim, cfg["block_n"]) * cfg["block_n"])
    out = pl.pallas_call(
        functools.partial(kernel, n_dim=n_dim, interpret=interpret, cfg=cfg),
        grid=(pl.cdiv(n_dim, cfg["block_n"]),),
        out_shape=jax.ShapeDtypeStruct(shape, x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"{name}_k{x.shape[1]}",
    )(*inputs)
    return out[:rows, :n_dim] if interpret else out


# ---------------------------------------------------------------------------------------------- matmul_add


def _matmul_add_kernel(x_ref, w_ref, res_ref, o_ref, *, n_dim, interpret, cfg):
    feats, feats_in = _features(cfg, n_dim)
    (acc,) = _project(x_ref, ((w_ref, feats_in),), **cfg)
    x_rows, row_ok = _row_index(cfg["rows"], cfg["rows_p"])
    res = pltriton.load(res_ref.at[x_rows[:, None], feats_in[None, :]], mask=row_ok[:, None], other=0)
    out = (res.astype(F32) + acc.astype(cfg["dtype"]).astype(F32)).astype(cfg["dtype"])
    _store_tile(o_ref, out, feats=feats, n_dim=n_dim, interpret=interpret, **cfg)


def matmul_add_unsupported(x, weight, residual) -> str | None:
    reason = _common_reason(x, (weight,))
    if reason is None and (residual.shape != (x.shape[0], weight.shape[0]) or residual.dtype != x.dtype):
        reason = f"residual must be [{x.shape[0]}, {weight.shape[0]}] {x.dtype}, got {residual.shape} {residual.dtype}"
    return reason


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "num_warps", "num_stages", "interpret"))
def matmul_add_kernel(x, weight, residual, *, block_k: int | None = None, block_n: int = _TILE, num_warps: int = 4,
                      num_stages: int = 4, interpret: bool = False):
    """``residual + x @ weight.T`` ([S, K] x [N, K] -> [S, N]) in one kernel."""
    reason = matmul_add_unsupported(x, weight, residual)
    if reason is not None:
        raise ValueError(f"matmul_add: {reason}")
    return _feature_tiled_call(
        _matmul_add_kernel, (x, weight, residual), x=x, n_dim=weight.shape[0], cfg=_config(x, block_k, block_n),
        name="matmul_add", num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )


def matmul_add(x, weight, residual):
    """Dispatch entry for "matmul_add": the kernel where it takes the shapes, else the jnp chain."""
    if matmul_add_unsupported(x, weight, residual) is not None:
        return reference.matmul_add(x, weight, residual)
    return matmul_add_kernel(x, weight, residual)


# ------------------------------------------------------------------------------------------ norm_gated_mlp


def _gated_mlp_kernel(x_ref, nw_ref, wg_ref, wu_ref, o_ref, *, eps, act, n_dim, interpret, cfg):
    dtype = cfg["dtype"]
    feats, feats_in = _features(cfg, n_dim)
    scale = _norm_scale(x_ref, eps, **cfg)
    gate, up = _project(x_ref, ((wg_ref, feats_in), (wu_ref, feats_in)), norm=(scale, nw_ref), **cfg)
    activated = _ACTIVATIONS[act](gate.astype(dtype).astype(F32)).astype(dtype)
    out = (activated.astype(F32) * up.astype(dtype).astype(F32)).astype(dtype)
    _store_tile(o_ref, out, feats=feats, n_dim=n_dim, interpret=interpret, **cfg)


_MLP_ACTIVATIONS = ("silu", "sigmoid", "relu", "gelu_pytorch_tanh")


def norm_gated_mlp_unsupported(x, norm_weight, eps, w_gate, w_up, act) -> str | None:
    reason = _common_reason(x, (w_gate, w_up))
    if reason is None and w_gate.shape != w_up.shape:
        reason = f"gate and up weights differ in shape: {w_gate.shape} vs {w_up.shape}"
    if reason is None and act not in _MLP_ACTIVATIONS:
        reason = f"activation {act!r} is not one of {_MLP_ACTIVATIONS}"
    if reason is None and (norm_weight.shape != (x.shape[1],) or norm_weight.dtype != x.dtype):
        reason = f"norm weight must be [{x.shape[1]}] {x.dtype}"
    return reason


@functools.partial(jax.jit, static_argnames=("eps", "act", "block_k", "block_n", "num_warps", "num_stages",
                                             "interpret"))
def norm_gated_mlp_kernel(x, norm_weight, eps, w_gate, w_up, act, *, block_k: int | None = None,
                          block_n: int = _TILE, num_warps: int = 4, num_stages: int = 4, interpret: bool = False):
    """``act(gate(rmsnorm(x))) * up(rmsnorm(x))`` ([S, D] -> [S, I]) in one kernel."""
    reason = norm_gated_mlp_unsupported(x, norm_weight, eps, w_gate, w_up, act)
    if reason is not None:
        raise ValueError(f"norm_gated_mlp: {reason}")
    return _feature_tiled_call(
        functools.partial(_gated_mlp_kernel, eps=eps, act=act), (x, norm_weight, w_gate, w_up), x=x,
        n_dim=w_gate.shape[0], cfg=_config(x, block_k, block_n), name="norm_gated_mlp", num_warps=num_warps,
        num_stages=num_stages, interpret=interpret,
    )


def norm_gated_mlp(x, norm_weight, eps, w_gate, w_up, act):
    """Dispatch entry for "norm_gated_mlp"."""
    if norm_gated_mlp_unsupported(x, norm_weight, eps, w_gate, w_up, act) is not None:
        return reference.norm_gated_mlp(x, norm_weight, eps, w_gate, w_up, act)
    return norm_gated_mlp_kernel(x, norm_weight, float(eps), w_gate, w_up, act)


# ------------------------------------------------------------------------------------- norm_qkv_rope_write


def _qkv_kernel(x_ref, nw_ref, wq_ref, wk_ref, wv_ref, cos_ref, sin_ref, slot_ref, kp_in, vp_in,
                q_ref, kp_ref, vp_ref, *, eps, heads, groups, head_dim, interpret, cfg):
    del kp_in, vp_in  # aliased to kp_ref / vp_ref
    rows, rows_p, dtype = cfg["rows"], cfg["rows_p"], cfg["dtype"]
    half = head_dim // 2
    per_head = half // _TILE  # programs per head
    unit, part = pl.program_id(0) // per_head, pl.program_id(0) % per_head
    x_rows, row_ok = _row_index(rows, rows_p)
    c = part * _TILE + jnp.arange(_TILE, dtype=jnp.int32)  # this program's features of the first half
    scale = _norm_scale(x_ref, eps, **cfg)

    def rotated(w_ref, head, rope):
        base = head * head_dim
        lo, hi = _project(x_ref, ((w_ref, base + c), (w_ref, base + half + c)), norm=(scale, nw_ref), **cfg)
        lo, hi = lo.astype(dtype).astype(F32), hi.astype(dtype).astype(F32)
        if not rope:
            return lo, hi
        cos = pltriton.load(cos_ref.at[x_rows[:, None], c[None, :]]).astype(F32)
        sin = pltriton.load(sin_ref.at[x_rows[:, None], c[None, :]]).astype(F32)
        # The reference's cos/sin repeat the same angles over both halves: x * cos + rotate_half(x) * sin.
        return lo * cos - hi * sin, hi * cos + lo * sin

    r = jnp.arange(rows_p, dtype=jnp.int32)

    @pl.when(unit < heads)
    def _():
        lo, hi = rotated(wq_ref, unit, True)
        target = jnp.where(row_ok, r, rows + r) if interpret else x_rows
        for cols, value in ((c, lo), (half + c, hi)):
            pltriton.store(q_ref.at[target[:, None], unit, cols[None, :]], value.astype(dtype),
                           mask=row_ok[:, None])

    def write(w_ref, pages_ref, head, rope):
        lo, hi = rotated(w_ref, head, rope)
        slot = pltriton.load(slot_ref.at[x_rows], mask=row_ok, other=0)
        # Rows past the step's are masked; in the interpreter they write the sink slot (0), whose contents are
        # never read.
        slot = jnp.where(row_ok, slot, 0)
        for cols, value in ((c, lo), (half + c, hi)):
            pltriton.store(pages_ref.at[slot[:, None], head * head_dim + cols[None, :]], value.astype(dtype),
                           mask=row_ok[:, None])

    @pl.when((unit >= heads) & (unit < heads + groups))
    def _():
        write(wk_ref, kp_ref, unit - heads, True)

    @pl.when(unit >= heads + groups)
    def _():
        write(wv_ref, vp_ref, unit - heads - groups, False)


def norm_qkv_rope_write_unsupported(x, norm_weight, eps, wq, wk, wv, cos, sin, slots, k_pages, v_pages) -> str | None:
    reason = _common_reason(x, (wq, wk, wv))
    if reason is not None:
        return reason
    head_dim = cos.shape[-1]
    if head_dim % (2 * _TILE):
        return f"head_dim {head_dim} must be a multiple of {2 * _TILE} (RoPE halves in tiles of {_TILE})"
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.shape[3] != head_dim:
        return f"pages must be [P, page_size, G, {head_dim}], got {k_pages.shape} and {v_pages.shape}"
    groups = k_pages.shape[2]
    if wq.shape[0] % head_dim or wk.shape[0] != groups * head_dim or wv.shape != wk.shape:
        return f"projection widths {wq.shape[0]}, {wk.shape[0]}, {wv.shape[0]} do not match head_dim {head_dim} x G {groups}"
    if k_pages.dtype != x.dtype or v_pages.dtype != x.dtype or norm_weight.dtype != x.dtype:
        return "pages and norm weight must have x's dtype"
    if cos.shape != (x.shape[0], head_dim) or sin.shape != cos.shape or slots.shape != (x.shape[0],):
        return f"cos/sin must be [{x.shape[0]}, {head_dim}] and slots [{x.shape[0]}]"
    return None


@functools.partial(jax.jit, static_argnames=("eps", "block_k", "num_warps", "num_stages", "interpret"))
def norm_qkv_rope_write_kernel(x, norm_weight, eps, wq, wk, wv, cos, sin, slots, k_pages, v_pages, *,
                               block_k: int | None = None, num_warps: int = 4, num_stages: int = 4,
                               interpret: bool = False):
    """RMSNorm, Q/K/V projections, RoPE and the K/V page writes of one-token rows in one kernel."""
    reason = norm_qkv_rope_write_unsupported(x, norm_weight, eps, wq, wk, wv, cos, sin, slots, k_pages, v_pages)
    if reason is not None:
        raise ValueError(f"norm_qkv_rope_write: {reason}")
    cfg = _config(x, block_k)
    rows = x.shape[0]
    num_pages, page_size, groups, head_dim = k_pages.shape
    heads = wq.shape[0] // head_dim
    per_head = head_dim // 2 // _TILE
    out_rows = rows + cfg["rows_p"] if interpret else rows
    token_rows = (num_pages * page_size, groups * head_dim)
    q, k_rows, v_rows = pl.pallas_call(
        functools.partial(_qkv_kernel, eps=eps, heads=heads, groups=groups, head_dim=head_dim,
                          interpret=interpret, cfg=cfg),
        grid=((heads + 2 * groups) * per_head,),
        out_shape=(
            jax.ShapeDtypeStruct((out_rows, heads, head_dim), x.dtype),
            jax.ShapeDtypeStruct(token_rows, k_pages.dtype),
            jax.ShapeDtypeStruct(token_rows, v_pages.dtype),
        ),
        input_output_aliases={8: 1, 9: 2},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"norm_qkv_rope_write_k{x.shape[1]}",
    )(x, norm_weight, wq, wk, wv, cos, sin, slots.astype(jnp.int32), k_pages.reshape(token_rows),
      v_pages.reshape(token_rows))
    return (q[:rows] if interpret else q), k_rows.reshape(k_pages.shape), v_rows.reshape(v_pages.shape)


def norm_qkv_rope_write(x, norm_weight, eps, wq, wk, wv, cos, sin, slots, k_pages, v_pages):
    """Dispatch entry for "norm_qkv_rope_write"."""
    args = (x, norm_weight, eps, wq, wk, wv, cos, sin, slots, k_pages, v_pages)
    if norm_qkv_rope_write_unsupported(*args) is not None:
        return reference.norm_qkv_rope_write(*args)
    return norm_qkv_rope_write_kernel(x, norm_weight, float(eps), wq, wk, wv, cos, sin, slots, k_pages, v_pages)
