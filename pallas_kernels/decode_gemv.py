"""Decode-step projections for a few rows as weight-streaming GEMVs, fused with their neighbours, in Pallas (Triton
backend): the kernels of the chains in ``apriel2_jax.ops.decode_fused`` (the jnp oracle, same signatures).

Why. At one or two rows a decode step's projections read every weight once and do almost no arithmetic, so their
time is bytes over bandwidth plus each kernel's start and tail. XLA runs each as a reduce fusion with the norms,
the activation product and the residual add as kernels around them: an attention layer of the 0.5B geometry was
13 kernels at one row, 8 with these (H200 trace, 2026-11-25; the other three are the decode attention and its
split-K combine).

Design. One program per ``block_n`` output features (weight rows: the checkpoint's [out, in] layout keeps each
row contiguous). It walks the input width in chunks, loads [block_n, chunk] weight tiles, multiplies them by
each row's activations broadcast over the tile in fp32 and accumulates elementwise; one reduction over the chunk
axis at the end. No tensor-core dot: a dot's minimum of 16 rows would pad the step's rows and stage the tiles
through shared memory for nothing (an earlier dot-based version streamed at about half this rate). The chunk
loop is unrolled and loads go out a group of chunks ahead of the products that use them (see ``_gemv``).

- The RMSNorm is a prologue: each program sums the squares of its rows (a few KB, from L2), then normalises each
  chunk as it uses it with the reference's roundings (fp32 normalisation, cast to the dtype, times the weight in
  the dtype). The normalised activations never go to HBM.
- Outputs are rounded where the reference rounds: the projection, then the activation product or residual add.

Each product costs an FMA per weight element and row, and the accumulators grow with the rows, so the kernels
lose to XLA's tensor-core GEMMs beyond a row or two, and, being built to cut latency, to XLA's fusions on matrices
large enough to stream near the bandwidth: the dispatch entries take them only within ``KERNEL_MAX_WEIGHT_BYTES``
(by op and rows, measured).

fp32 inputs are multiplied and summed in fp32, so the kernels match the fp32 oracle to summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from apriel2_jax import dispatch
from apriel2_jax.ops import decode_fused as reference
from apriel2_jax.ops.norms import _ACTIVATIONS

from . import causal_conv1d

F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_ROWS = 8  # the kernels' limit: each row adds a product per weight element and its accumulators
MiB = 2**20
# The dispatch entries' limits: the most weight bytes of one call (per device: under tensor parallelism the
# entries see their shard) for which each op runs its kernel, by op and rows; rows not listed run the jnp chain,
# whose matmuls XLA streams through its fusions and tensor-core GEMMs. The kernels pay for latency (a kernel's
# start and tail, a few µs) that small matrices cannot hide, while a large matrix streams long enough for XLA to
# reach the bandwidth, which the kernels, built to cut latency, do not. Each limit sits just above the largest
# weight measured below the op's first loss (both of the kernel's timings above XLA's). Measured with
# ``scripts/bench_decode_mlp.py --gemv-max-weight-mib`` (the kernel forced against XLA, layers chained, µs per
# layer; H200, 2026-11-29):
# - norm + Q/K/V (Q [h, h], K and V [h/4, h]; ``--sections qkv``): one row ties or wins up to h = 1536 (7.1 MB),
#   loses from 1792 (9.6 MB: 7.4-7.6 against 6.4-6.7; 12.6 MB: 10.9-11.1 against 7.7-8.8); two rows win at
#   1280 (4.9 MB), lose from 1536 (7.1 MB: 8.0-8.1 against 6.3-7.3).
# - norm + gate/up + product at one row (the down projection in XLA): wins up to [2560 -> 6912] (70.8 MB: 36.9-37.3
#   against 38.0), loses at [3072 -> 8192] (100.7 MB: 47.5-47.7 against 46.3). At two rows the MLP kernels took
#   18.7 µs per layer against XLA's 16.7 at the 0.5B geometry.
# - down + residual (gate/up in XLA): one row wins up to 35.4 MB (35.4-35.6 against 37.5), loses at 50.3 MB
#   (46.6-47.0 against 46.3; it won again at 90.2 MB); two rows win at 12.6 MB (18.7 against 19.6), lose at 23.1 MB
#   (28.5-28.8 against 26.6).
# The 15B geometry's calls (42-294 MB) all run XLA; there every kernel had cost up to 21% of the step
# (superapriel-15b-shaped all-attention, context 1024, ms per step with every kernel / none: B=1 9.145 / 8.044, B=2
# 10.097 / 8.003). Above two rows (one for gate/up) the kernels lost where measured (the 0.5B geometry): each row
# adds a product per weight element and its accumulators (at 4 rows the Q/K/V kernel took the 0.5B step from 1.15
# to 1.51 ms).
KERNEL_MAX_WEIGHT_BYTES = {
    "norm_projections": {1: 7 * MiB, 2: 5 * MiB},
    "norm_gated_mlp": {1: 68 * MiB},
    "matmul_add": {1: 34 * MiB, 2: 13 * MiB},
}
KERNEL_ROWS = {op: max(limits) for op, limits in KERNEL_MAX_WEIGHT_BYTES.items()}  # the most rows each op takes
_MLP_ACTIVATIONS = ("silu", "sigmoid", "relu", "gelu_pytorch_tanh")
# A step reads each weight once: its lines go first from L2, ahead of the activations, K/V and states the step
# reads again. 24 layers of the 0.5B MLP (norm + gate/up, down) chained: 13.28 µs per layer against 13.67-13.70
# with the default policy (H200, 2026-11-26).
WEIGHT_EVICTION = "evict_first"


def _chunk(k_dim: int, chunk: int | None) -> int | None:
    """The input-width chunk: the largest power of two <= ``chunk`` (default 256) dividing the width, at least
    16; None where the width has no such divisor."""
    limit = chunk or 256
    for size in (512, 256, 128, 64, 32, 16):
        if size <= limit and k_dim % size == 0:
            return size
    return None


def _common_reason(x, weights, norm_weight=None) -> str | None:
    if x.ndim != 2:
        return "x must be [rows, features]"
    if jnp.dtype(x.dtype) not in _DTYPES or any(w.dtype != x.dtype for w in weights):
        return f"dtypes must be one of f32/bf16/f16 and equal (x {x.dtype}, weights {[str(w.dtype) for w in weights]})"
    if not 1 <= x.shape[0] <= MAX_ROWS:
        return f"between 1 and {MAX_ROWS} rows (got {x.shape[0]})"
    if any(w.ndim != 2 or w.shape[1] != x.shape[1] for w in weights):
        return f"weights must be [out, {x.shape[1]}], got {[w.shape for w in weights]}"
    if _chunk(x.shape[1], None) is None:
        return f"input width {x.shape[1]} must be a multiple of 16"
    if norm_weight is not None and (norm_weight.shape != (x.shape[1],) or norm_weight.dtype != x.dtype):
        return f"norm weight must be [{x.shape[1]}] {x.dtype}"
    return None


def takes(op: str, reason: str | None, rows: int, weights) -> bool:
    """Whether the dispatch entry of ``op`` runs its kernel: shapes it takes, and ``weights`` within
    ``KERNEL_MAX_WEIGHT_BYTES[op][rows]``."""
    limit = KERNEL_MAX_WEIGHT_BYTES[op].get(rows)
    weight_bytes = sum(w.size * jnp.dtype(w.dtype).itemsize for w in weights)
    return reason is None and limit is not None and weight_bytes <= limit


def _row_scales(x_ref, eps, *, rows, k_dim, chunk):
    """rsqrt(mean(x^2) + eps) of each row in fp32 (every chunk loaded before the first sum)."""
    xs = [[x_ref[r, pl.ds(c * chunk, chunk)] for c in range(k_dim // chunk)] for r in range(rows)]
    scales = []
    for row in xs:
        total = sum(jnp.sum(x.astype(F32) * x.astype(F32)) for x in row)
        scales.append(jax.lax.rsqrt(total / k_dim + eps))
    return scales


def _load_weights(w_ref, tile_rows, cols):
    """A [block_n, chunk] weight tile, first out of L2 (``WEIGHT_EVICTION``). A ragged last tile's clamped row
    indices load plainly (Pallas's interpreter takes no cache hints on mixed array and slice indexing)."""
    if isinstance(tile_rows, pl.Slice):
        return pltriton.load(w_ref.at[tile_rows, cols], eviction_policy=WEIGHT_EVICTION)
    return w_ref[tile_rows, cols]


def _gemv(x_ref, weights, *, rows, k_dim, chunk, depth, prefetch=True, norm=None):
    """fp32 sums ``acc[r][j]`` [block_n] of row r's activations (RMS-normalised with ``norm = (eps, norm_ref)``)
    times the weight rows of ``weights[j] = (w_ref, tile_rows)``.

    Loads (weight tiles, the rows' activations, the norm weight) go out in groups of ``depth`` chunks, and with
    ``prefetch`` the next group's before this group's products: a warp issues in order and stalls at the first
    product whose operands have not arrived, so loads interleaved with products would leave one chunk in flight
    per warp. The norm's sums of squares come after the first group's loads are issued, so the weights stream
    while it runs. Products accumulate elementwise and are reduced across the chunk once at the end: a reduction
    per chunk synchronises the program's threads between its loads."""
    if depth < 1:
        raise ValueError(f"depth={depth}: the chunks loaded per group must be at least 1")
    chunks = k_dim // chunk
    groups = [range(first, min(first + depth, chunks)) for first in range(0, chunks, depth)]

    def load(group):
        cols = {c: pl.ds(c * chunk, chunk) for c in group}
        return (
            {c: [_load_weights(w_ref, tile_rows, cols[c]) for w_ref, tile_rows in weights] for c in group},
            {c: [x_ref[r, cols[c]] for r in range(rows)] for c in group},
            {c: norm[1][cols[c]] for c in group} if norm is not None else None,
        )

    accs = [[None] * len(weights) for _ in range(rows)]
    loaded = load(groups[0])
    scales = None if norm is None else _row_scales(x_ref, norm[0], rows=rows, k_dim=k_dim, chunk=chunk)
    for i, group in enumerate(groups):
        tiles, xs, norm_ws = loaded if prefetch or i == 0 else load(group)
        if prefetch and i + 1 < len(groups):
            loaded = load(groups[i + 1])
        for c in group:
            for r in range(rows):
                x = xs[c][r]
                if norm is not None:
                    normed = (x.astype(F32) * scales[r]).astype(x.dtype)
                    x = (norm_ws[c].astype(F32) * normed.astype(F32)).astype(x.dtype)
                x = x.astype(F32)[None, :]
                for j, tile in enumerate(tiles[c]):
                    product = tile.astype(F32) * x
                    accs[r][j] = product if accs[r][j] is None else accs[r][j] + product
    return [[jnp.sum(acc, axis=1) for acc in row] for row in accs]


def _tile(n_dim: int, block_n: int, tile):
    """The weight rows of output tile ``tile``: a slice where tiles divide the width, else clamped indices
    (features past the width load the last row and are never stored)."""
    if n_dim % block_n == 0:
        return pl.ds(tile * block_n, block_n)
    return jnp.minimum(tile * block_n + jnp.arange(block_n, dtype=jnp.int32), n_dim - 1)


def _store(o_ref, r, tile, value, *, n_dim, block_n, offset=0):
    """Row r's features ``[tile * block_n, +block_n)`` of an output of width ``n_dim`` (at column ``offset`` of
    ``o_ref`` where tiles divide the width; a ragged last tile needs the output to itself)."""
    if n_dim % block_n == 0:
        o_ref[r, pl.ds(offset + tile * block_n, block_n)] = value.astype(o_ref.dtype)
        return
    feats = tile * block_n + jnp.arange(block_n, dtype=jnp.int32)
    # Masked lanes keep in-bounds (clamped) addresses; the GPU never writes them. The interpreter writes old
    # contents back there, after the real lanes' values in the same scatter, so a clamped duplicate could win:
    # there the output carries ``block_n`` spare columns past its end and masked lanes address those.
    spare = o_ref.shape[1] == n_dim + block_n
    target = jnp.where(feats < n_dim, feats, n_dim + feats % block_n) if spare else jnp.minimum(feats, n_dim - 1)
    pltriton.store(o_ref.at[r, target], value.astype(o_ref.dtype), mask=feats < n_dim)


def _call(kernel, inputs, *, x, n_dim, block_n, name, num_warps, interpret, programs=None):
    """One program per ``block_n`` features of an [S, n_dim] output in x's dtype (or ``programs`` of them, for
    projections side by side in tiles of their own)."""
    rows = x.shape[0]
    ragged = programs is None and n_dim % block_n  # a ragged last tile (see ``_store``)
    width = n_dim + (block_n if interpret and ragged else 0)
    out = pl.pallas_call(
        kernel,
        grid=(programs or pl.cdiv(n_dim, block_n),),
        out_shape=jax.ShapeDtypeStruct((rows, width), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"{name}_k{x.shape[1]}",
    )(*inputs)
    return out[:, :n_dim] if width != n_dim else out


# ---------------------------------------------------------------------------------------------- matmul_add


def _matmul_add_kernel(x_ref, w_ref, res_ref, o_ref, *, rows, k_dim, chunk, depth, prefetch, n_dim, block_n):
    tile = pl.program_id(0)
    rows_of_w = _tile(n_dim, block_n, tile)
    residuals = [res_ref[r, rows_of_w] for r in range(rows)]  # loaded while the weights stream
    accs = _gemv(x_ref, [(w_ref, rows_of_w)], rows=rows, k_dim=k_dim, chunk=chunk, depth=depth,
                 prefetch=prefetch)
    for r in range(rows):
        out = residuals[r].astype(F32) + accs[r][0].astype(o_ref.dtype).astype(F32)
        _store(o_ref, r, tile, out, n_dim=n_dim, block_n=block_n)


def matmul_add_unsupported(x, weight, residual) -> str | None:
    reason = _common_reason(x, (weight,))
    if reason is None and (residual.shape != (x.shape[0], weight.shape[0]) or residual.dtype != x.dtype):
        reason = f"residual must be [{x.shape[0]}, {weight.shape[0]}] {x.dtype}, got {residual.shape} {residual.dtype}"
    return reason


@functools.partial(jax.jit, static_argnames=("chunk", "depth", "prefetch", "block_n", "num_warps", "interpret"))
def matmul_add_kernel(x, weight, residual, *, chunk: int | None = None, depth: int = 4, prefetch: bool = True,
                      block_n: int = 4, num_warps: int = 8, interpret: bool = False):
    """``residual + x @ weight.T`` ([S, K] x [N, K] -> [S, N]) in one kernel, S <= MAX_ROWS. Tiles of 4 features
    (224 programs for the 0.5B geometry's 896 outputs, on 132 SMs): against 8, ~1% off the 0.5B one-row step and
    2-3% off the two-row step; 2-feature tiles were 3-4% slower at two rows (H200, 0.5B only, docs/BENCHMARKS.md)."""
    reason = matmul_add_unsupported(x, weight, residual)
    if reason is not None:
        raise ValueError(f"matmul_add: {reason}")
    n_dim = weight.shape[0]
    kernel = functools.partial(_matmul_add_kernel, rows=x.shape[0], k_dim=x.shape[1], chunk=_chunk(x.shape[1], chunk),
                               depth=depth, prefetch=prefetch, n_dim=n_dim, block_n=block_n)
    return _call(kernel, (x, weight, residual), x=x, n_dim=n_dim, block_n=block_n, name="gemv_add",
                 num_warps=num_warps, interpret=interpret)


def matmul_add(x, weight, residual):
    """Dispatch entry for "matmul_add": the kernel where it takes the shapes, else the jnp chain."""
    if not takes("matmul_add", matmul_add_unsupported(x, weight, residual), x.shape[0], (weight,)):
        return reference.matmul_add(x, weight, residual)
    return matmul_add_kernel(x, weight, residual)


# ------------------------------------------------------------------------------------------ norm_gated_mlp


def _gated_mlp_kernel(x_ref, nw_ref, wg_ref, wu_ref, o_ref, *, eps, act, rows, k_dim, chunk, depth, prefetch,
                      n_dim, block_n):
    tile = pl.program_id(0)
    rows_of_w = _tile(n_dim, block_n, tile)
    accs = _gemv(x_ref, [(wg_ref, rows_of_w), (wu_ref, rows_of_w)], rows=rows, k_dim=k_dim, chunk=chunk,
                 depth=depth, prefetch=prefetch, norm=(eps, nw_ref))
    dtype = o_ref.dtype
    for r in range(rows):
        gate, up = accs[r]
        activated = _ACTIVATIONS[act](gate.astype(dtype).astype(F32)).astype(dtype)
        _store(o_ref, r, tile, activated.astype(F32) * up.astype(dtype).astype(F32), n_dim=n_dim, block_n=block_n)


def norm_gated_mlp_unsupported(x, norm_weight, eps, w_gate, w_up, act) -> str | None:
    reason = _common_reason(x, (w_gate, w_up), norm_weight)
    if reason is None and w_gate.shape != w_up.shape:
        reason = f"gate and up weights differ in shape: {w_gate.shape} vs {w_up.shape}"
    if reason is None and act not in _MLP_ACTIVATIONS:
        reason = f"activation {act!r} is not one of {_MLP_ACTIVATIONS}"
    return reason


NARROW_INPUT_CHUNKS = 8  # inputs of up to this many chunks load 2 chunks ahead in the gate/up GEMV


def gated_mlp_depth(k_dim: int, chunk: int) -> int:
    """The gate/up GEMV's default group of chunks (``norm_gated_mlp_kernel``): 2 for inputs of up to
    ``NARROW_INPUT_CHUNKS`` chunks (measured at the 0.5B's 896), else 8."""
    return 2 if k_dim // chunk <= NARROW_INPUT_CHUNKS else 8


@functools.partial(jax.jit, static_argnames=("eps", "act", "chunk", "depth", "prefetch", "block_n", "num_warps",
                                             "interpret"))
def norm_gated_mlp_kernel(x, norm_weight, eps, w_gate, w_up, act, *, chunk: int | None = None,
                          depth: int | None = None, prefetch: bool = True, block_n: int = 4, num_warps: int = 4,
                          interpret: bool = False):
    """``act(gate(rmsnorm(x))) * up(rmsnorm(x))`` ([S, D] -> [S, I]) in one kernel, S <= MAX_ROWS. Tiles of 4
    features: 8 against 16 took ~1% off the 0.5B one-row step, 4 against 8 alone ~0.7% (within the processes'
    spread), and with matmul_add's 4-feature tiles the pair 2-3% (H200, 0.5B only, docs/BENCHMARKS.md).

    ``depth`` (default ``gated_mlp_depth``): groups of 2 chunks (two groups in flight with the prefetch) for
    inputs of up to ``NARROW_INPUT_CHUNKS`` chunks, not all 7 of the 0.5B input at once. With all 7, Nsight
    Compute read 72 registers per thread, registers limiting an SM to 7 programs, and 1.32 waves of the 1216
    programs (H200); at 2, 60 registers, 8 programs per SM and 1.15 waves (Nsight Compute, H200, 2026-11-29;
    one chunk ahead, 48 registers and one wave, was slower: docs/BENCHMARKS.md). The one-row
    step: all-attention 0.630, 0.630 ms against 0.648, 0.645, pure-gdn 0.596, 0.597 against 0.607, 0.612
    (docs/BENCHMARKS.md). Wider inputs (the 15B's 5120: 20 chunks) keep groups of 8, where the change was not
    measured. The grouping only orders the loads: in interpret mode the outputs are bitwise the same."""
    reason = norm_gated_mlp_unsupported(x, norm_weight, eps, w_gate, w_up, act)
    if reason is not None:
        raise ValueError(f"norm_gated_mlp: {reason}")
    chunk = _chunk(x.shape[1], chunk)
    if depth is None:
        depth = gated_mlp_depth(x.shape[1], chunk)
    n_dim = w_gate.shape[0]
    kernel = functools.partial(_gated_mlp_kernel, eps=eps, act=act, rows=x.shape[0], k_dim=x.shape[1],
                               chunk=chunk, depth=depth, prefetch=prefetch, n_dim=n_dim,
                               block_n=block_n)
    return _call(kernel, (x, norm_weight, w_gate, w_up), x=x, n_dim=n_dim, block_n=block_n,
                 name="gemv_norm_gated_mlp", num_warps=num_warps, interpret=interpret)


def norm_gated_mlp(x, norm_weight, eps, w_gate, w_up, act):
    """Dispatch entry for "norm_gated_mlp"."""
    reason = norm_gated_mlp_unsupported(x, norm_weight, eps, w_gate, w_up, act)
    if not takes("norm_gated_mlp", reason, x.shape[0], (w_gate, w_up)):
        return reference.norm_gated_mlp(x, norm_weight, eps, w_gate, w_up, act)
    return norm_gated_mlp_kernel(x, norm_weight, float(eps), w_gate, w_up, act)


# ---------------------------------------------------------------------------------------- norm_projections


def _norm_projections_kernel(x_ref, nw_ref, *refs, eps, rows, k_dim, chunk, depth, widths, blocks, conv_channels=0,
                             barrier=False):
    """``conv_channels`` > 0: refs also hold the conv's (slots, fresh, weight [Kc, C], bias, pool in) after the
    weights and its pool out after the output, and the first projection's first C features leave through the conv
    (``causal_conv1d``'s decode step on each projected tile)."""
    w_refs, o_ref = refs[: len(widths)], refs[len(widths) + (5 if conv_channels else 0)]
    conv_refs = (*refs[len(widths) : len(widths) + 4], refs[-1]) if conv_channels else None
    program = pl.program_id(0)
    # (projection, its first tile here, tiles, whether they go through the conv), one program per tile
    segments = []
    for j, (width, block_n) in enumerate(zip(widths, blocks)):
        conv_tiles = conv_channels // block_n if j == 0 else 0
        if conv_tiles:
            segments.append((j, 0, conv_tiles, True))
        if width // block_n > conv_tiles:
            segments.append((j, conv_tiles, width // block_n - conv_tiles, False))
    offsets = [sum(widths[:j]) for j in range(len(widths))]
    start = 0
    for j, first, tiles, conv in segments:
        block_n = blocks[j]

        @pl.when((program >= start) & (program < start + tiles))
        def _(j=j, tile=program - start + first, block_n=block_n, conv=conv):
            cols = pl.ds(tile * block_n, block_n)
            if conv:  # the conv state's loads go out before the weights' and are in flight with them
                slots_ref, fresh_ref, cw_ref, cb_ref, pool_ref = conv_refs
                windows = [causal_conv1d.previous_inputs(pool_ref, slots_ref[r], fresh_ref[r] != 0, cols,
                                                         o_ref.dtype) for r in range(rows)]
            accs = _gemv(x_ref, [(w_refs[j], cols)], rows=rows, k_dim=k_dim, chunk=chunk, depth=depth,
                         norm=(eps, nw_ref))
            for r in range(rows):
                out = accs[r][0]
                if conv:  # on the projection rounded to the dtype, as the conv kernel reads it
                    out = causal_conv1d.decode_output(windows[r], out.astype(o_ref.dtype), cw_ref, cb_ref, cols)
                _store(o_ref, r, tile, out, n_dim=widths[j], block_n=block_n, offset=offsets[j])
            if conv:
                if barrier:  # every load of the old conv state before a store of the new one
                    pltriton.debug_barrier()
                for r in range(rows):
                    causal_conv1d.store_state(pool_ref, slots_ref[r], cols, windows[r],
                                              accs[r][0].astype(o_ref.dtype))

        start += tiles


def _projection_tiles(widths) -> tuple[int, ...]:
    """Each projection's tile: the largest of 4, 2, 1 output features dividing its width. One program never
    spans two projections, and a narrow one (GDN's b|a gates: 2 x 14 features) takes small tiles of its own
    instead of shrinking the wide ones' (its q|k|v|z: 2048). More programs stream the weights sooner than fewer
    (each loads its first tiles before it can multiply): at the 0.5B geometry, 8-feature tiles instead of 16 took
    the every2-kda step at two rows from 0.869 to 0.815 ms, and 32-feature tiles for KDA's projections (95
    programs, one wave, instead of 183) made its one-row step 13% slower. 4-feature tiles instead of 8 took the
    every2-kda two-row step from 0.811 to 0.793 ms (H200, docs/BENCHMARKS.md)."""
    return tuple(next(b for b in (4, 2, 1) if w % b == 0) for w in widths)


def norm_projections_unsupported(x, norm_weight, eps, weights) -> str | None:
    return _common_reason(x, tuple(weights), norm_weight)


@functools.partial(jax.jit, static_argnames=("eps", "chunk", "depth", "block_n", "num_warps", "interpret"))
def norm_projections_kernel(x, norm_weight, eps, weights, *, chunk: int | None = None, depth: int = 8,
                            block_n: int | None = None, num_warps: int = 4, interpret: bool = False):
    """``concat([rmsnorm(x) @ w.T for w in weights], -1)`` ([S, D] -> [S, sum N_i]) in one kernel, S <= MAX_ROWS.
    ``block_n``, where given, is every projection's tile and must divide every width (default: each projection's
    own, ``_projection_tiles``)."""
    reason = norm_projections_unsupported(x, norm_weight, eps, weights)
    widths = tuple(w.shape[0] for w in weights)
    blocks = _projection_tiles(widths) if block_n is None else (block_n,) * len(widths)
    if reason is None and any(w % b for w, b in zip(widths, blocks)):
        reason = f"block_n={block_n} does not divide the projection widths {widths}"
    if reason is not None:
        raise ValueError(f"norm_projections: {reason}")
    kernel = functools.partial(_norm_projections_kernel, eps=eps, rows=x.shape[0], k_dim=x.shape[1],
                               chunk=_chunk(x.shape[1], chunk), depth=depth, widths=widths, blocks=blocks)
    return _call(kernel, (x, norm_weight, *weights), x=x, n_dim=sum(widths), block_n=max(blocks),
                 programs=sum(w // b for w, b in zip(widths, blocks)), name="gemv_norm_projections",
                 num_warps=num_warps, interpret=interpret)


def norm_projections(x, norm_weight, eps, weights, pad_columns: bool = False):
    """Dispatch entry for "norm_projections" (its output has no padding columns)."""
    del pad_columns
    if not takes("norm_projections", norm_projections_unsupported(x, norm_weight, eps, weights), x.shape[0],
                  weights):
        return reference.norm_projections(x, norm_weight, eps, weights)
    return norm_projections_kernel(x, norm_weight, float(eps), tuple(weights))


# ----------------------------------------------------------------------------------- norm_projections_conv


def norm_projections_conv_unsupported(x, norm_weight, eps, weights, conv_weight, conv_bias, conv_pool, slots=None,
                                      fresh=None) -> str | None:
    """Why the kernel cannot take the op's arguments (None where it can); the rows' slots and flags never stop it."""
    del slots, fresh
    reason = norm_projections_unsupported(x, norm_weight, eps, weights)
    if reason is not None:
        return reason
    channels, taps = conv_weight.shape
    if taps < 2 or conv_pool.shape[1:] != (taps - 1, channels):
        return f"conv weight [C, Kc >= 2] and pool [P, Kc-1, C] disagree: {conv_weight.shape}, {conv_pool.shape}"
    if conv_bias is not None and conv_bias.shape != (channels,):
        return f"conv bias must be [{channels}], got {conv_bias.shape}"
    block = _projection_tiles((weights[0].shape[0],))[0]
    if channels > weights[0].shape[0] or channels % block:
        return (f"the conv's {channels} channels must be whole tiles ({block} features) of the first projection's "
                f"{weights[0].shape[0]}")
    return None


@functools.partial(jax.jit, static_argnames=("eps", "chunk", "depth", "num_warps", "interpret"),
                   donate_argnames=("conv_pool",))
def norm_projections_conv_kernel(x, norm_weight, eps, weights, conv_weight, conv_bias, conv_pool, slots, fresh, *,
                                 chunk: int | None = None, depth: int = 8, num_warps: int = 4,
                                 interpret: bool = False):
    """``ops.decode_fused.norm_projections_conv`` in one kernel, S <= MAX_ROWS: the programs of the conv's channels
    run the conv (silu) on their projected tile and update their channels of the rows' pool slots in place."""
    reason = norm_projections_conv_unsupported(x, norm_weight, eps, weights, conv_weight, conv_bias, conv_pool)
    if reason is not None:
        raise ValueError(f"norm_projections_conv: {reason}")
    widths = tuple(w.shape[0] for w in weights)
    blocks = _projection_tiles(widths)
    channels = conv_weight.shape[0]
    kernel = functools.partial(_norm_projections_kernel, eps=eps, rows=x.shape[0], k_dim=x.shape[1],
                               chunk=_chunk(x.shape[1], chunk), depth=depth, widths=widths, blocks=blocks,
                               conv_channels=channels, barrier=not interpret)
    bias = jnp.zeros((channels,), F32) if conv_bias is None else conv_bias
    inputs = (x, norm_weight, *weights, slots.astype(jnp.int32), fresh.astype(jnp.int32), conv_weight.T, bias,
              conv_pool)
    return pl.pallas_call(
        kernel,
        grid=(sum(w // b for w, b in zip(widths, blocks)),),
        out_shape=(jax.ShapeDtypeStruct((x.shape[0], sum(widths)), x.dtype),
                   jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype)),
        input_output_aliases={len(inputs) - 1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"gemv_norm_projections_conv_k{x.shape[1]}",
    )(*inputs)


def norm_projections_conv(x, norm_weight, eps, weights, conv_weight, conv_bias, conv_pool, slots, fresh,
                          pad_columns: bool = False):
    """Dispatch entry for "norm_projections_conv": the kernel within ``KERNEL_MAX_WEIGHT_BYTES["norm_projections"]``;
    otherwise the dispatched projections (``decode_projections``' kernel from 8 rows, XLA's GEMMs elsewhere) and
    the conv kernel writing its output over its input columns (no concatenation)."""
    weights = tuple(weights)
    reason = norm_projections_conv_unsupported(x, norm_weight, eps, weights, conv_weight, conv_bias, conv_pool)
    if takes("norm_projections", reason, x.shape[0], weights):
        return norm_projections_conv_kernel(x, norm_weight, float(eps), weights, conv_weight, conv_bias, conv_pool,
                                            slots, fresh)
    proj = dispatch.op("norm_projections")(x, norm_weight, eps, weights, pad_columns)
    return causal_conv1d.decode_slots_over_input(proj, conv_weight, conv_bias, conv_pool, slots, fresh)
