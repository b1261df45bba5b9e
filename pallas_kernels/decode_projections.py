"""A decode step's input projections (an RMSNorm's output times several [out, in] weights, their outputs side by
side) for 8-32 rows as one Mosaic GPU kernel: TMA loads, wgmma with the rows as the M operand and a narrow tile
of output features as N. The jnp oracle is ``apriel2_jax.ops.decode_fused.norm_projections``; the entry runs the
RMSNorm before the kernel in XLA.

Why. Attention's Q/K/V projections are small (2 MB at the 0.5B geometry) and XLA runs them at 8-32 rows as a
Triton GEMM split four ways over its input, a second fusion summing the splits, and the norm as a third: ~7 µs
per layer for bytes that stream in well under one. What costs is each kernel's start and first-load latency, and
few CTAs streaming each: a tile of 64 output features (wgmma's M with the weights as the A operand, as in
``decode_gated_product``) would give the 1152 Q/K/V features 18 CTAs.

Design. CTA ``p`` owns output features [N p, N p + N) of the concatenated projections, N the tile (16 at the 0.5B
geometry: 72 CTAs), and computes them over the whole input width, so its TMA store is its only write and no
partial sums go through HBM.
- It issues every load at once: the normalised rows' [rows, 128] blocks into the first rows of [64, 128] A
  operand blocks (the rows past them are never written; their products land in accumulator rows that are never
  stored), then its [N, 128] weight blocks, the B operands (transposed: the checkpoint's [out, in] rows).
- It multiplies block by block as they land, rounds the fp32 sum to the dtype (as ``Linear``) and stores its
  [rows, N] tile with one TMA store.
- The norm stays an XLA fusion: normalising the rows in SMEM inside the kernel (every CTA, from the raw rows)
  cost ~2.6 µs per layer more than that fusion (docs/BENCHMARKS.md).
- Every block of both operands stays in SMEM, so the input width is bounded (7 blocks at 896, 11 at most with
  N = 16); wider inputs fall back to the jnp chain.
- Every projection's width but the last must be a multiple of the tile. TMA copies between GMEM and swizzled
  SMEM tiles need each tiled dimension of the whole array (a weight's rows, the output's columns) to be a
  multiple of the tile (jax 0.11.2), so a narrow last projection (KDA's beta, 14 features; GDN's b|a, 28) is
  neither read into a swizzled tile nor stored as a partial one:
  - its CTAs TMA its rows into plain SMEM and copy them into the swizzled B operand blocks themselves (an XLA
    pad of the weight ran as a kernel of its own in every decode step: XLA keeps it inside the device loop);
  - the output keeps its width rounded up to the tile. The entry drops the padding columns (an XLA copy) unless
    the caller passes ``pad_columns`` (KDA and GDN read the buffer at their columns' offsets).
  Dropping both took the H100's pure-gdn step from 1.152-1.157 to 1.094-1.107 ms at 32 rows (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from apriel2_jax.ops.norms import rms_norm

from . import decode_gemv
from .decode_mlp import BLOCK_K, _bf16_tiles

F32 = jnp.float32
# A narrow projection's staged rows in registers: four rows per warp, 16 contiguous bytes per thread (a plain
# SMEM load, and a swizzled store without bank conflicts)
STAGE_LAYOUT = plgpu.Layout.TILED(mgpu_fa.Tiling(((16, 64), (4, 64), (8,))), warp_dims=(-5,), lane_dims=(-3, -2),
                                  vector_dim=-1)
M = 64  # wgmma's M: the rows, padded in SMEM
TILES = (16, 32, 64)  # output features per CTA, narrowest first: more CTAs stream the weights sooner
MAX_ROWS = 32
MIN_ROWS = 8  # fewer rows: decode_gemv's kernel (one or two rows) or XLA's GEMV fusions; this kernel at one row took
# the all-attention B=1 step from 0.64 to 0.76 ms (0.5B, H200, 2026-11-29)
SMEM_BYTES = 220 * 1024  # of the 227 KB a Hopper CTA may use: headroom for barriers and Mosaic's scratch


@dataclasses.dataclass(frozen=True)
class Schedule:
    rows: int  # padded to 8
    k_dim: int
    widths: tuple[int, ...]  # each projection's output features, the last rounded up to the tile
    tile: int  # output features per CTA
    features: int = 0  # the projections' features before that rounding (default: sum(widths))

    @property
    def last_padding(self) -> int:
        """The last projection's width past its features: the rounding of its width up to the tile."""
        return sum(self.widths) - (self.features or sum(self.widths))

    @property
    def stage_rows(self) -> int:
        """Rows of a narrow last projection's plain staging blocks (``projections``): its rows per tile, in
        multiples of ``STAGE_LAYOUT``'s 16."""
        narrow_rows = self.widths[-1] - self.last_padding
        return min(self.tile, -(-narrow_rows // 16) * 16)

    @property
    def blocks(self) -> int:
        return self.k_dim // BLOCK_K

    @property
    def ctas(self) -> int:
        return sum(self.widths) // self.tile

    def smem_bytes(self) -> int:
        """Every block of the rows (padded to M) and of the CTA's weights, the output tile, and a narrow last
        projection's plain staging blocks."""
        staging = self.blocks * self.stage_rows * BLOCK_K * 2 if self.last_padding else 0
        return self.blocks * (M + self.tile) * BLOCK_K * 2 + M * self.tile * 2 + staging


def schedule(rows: int, k_dim: int, widths: tuple[int, ...], sms: int) -> Schedule | None:
    """The kernel's schedule for ``rows`` rows of projections [k_dim -> widths], or None where it does not fit:
    more than ``MAX_ROWS`` rows, an input width not a multiple of 128 or too wide for the SMEM, or no tile in
    ``TILES`` dividing every width but the last with at most one CTA per SM. The narrowest such tile. The last
    projection's width is rounded up to it (KDA's beta of 14 features, GDN's b|a of 28): the kernel's output has
    columns past the projections'. Plain Python: the entry decides with it at trace time."""
    if not 1 <= rows <= MAX_ROWS or k_dim % BLOCK_K or not widths:
        return None
    rows8 = -(-rows // 8) * 8
    for tile in TILES:
        rounded = (*widths[:-1], -(-widths[-1] // tile) * tile)
        plan = Schedule(rows8, k_dim, rounded, tile, sum(widths))
        if all(w % tile == 0 for w in widths[:-1]) and plan.ctas <= sms and plan.smem_bytes() <= SMEM_BYTES:
            return plan
    return None


def _output_tiles(tile: int):
    """Transforms of the [64, tile] bf16 output block: the operand blocks' (``_bf16_tiles``) from 64 features, the
    swizzle of the row's bytes below."""
    if tile >= 64:
        return _bf16_tiles()
    return (plgpu.TilingTransform((8, tile)), plgpu.SwizzleTransform(tile * 2))


def rows_by_weight_blocks(a_smem, a_ready, w_smem, w_ready, blocks: int, features: int) -> jax.Array:
    """Inside a kernel: ``sum_c a_smem[c] @ w_smem[c].T`` over ``blocks`` SMEM blocks, each pair multiplied as its
    two loads land (``a_ready[c]``, ``w_ready[c]``). a_smem: [blocks, M, 128] rows (wgmma's A operand); w_smem:
    [blocks, features, 128] weight rows (the transposed B operand). Returns the float32 [M, features] sum."""

    def accumulate(acc):
        for c in range(blocks):
            plgpu.barrier_wait(a_ready.at[c])
            plgpu.barrier_wait(w_ready.at[c])
            plgpu.wgmma(acc, a_smem.at[c], w_smem.at[c].transpose((1, 0)))
        plgpu.wgmma_wait(0)
        return acc[...]

    return pl.run_scoped(accumulate, plgpu.ACC((M, features), F32))


def projections(h: jax.Array, weights: tuple[jax.Array, ...], *, plan: Schedule) -> jax.Array:
    """h: [rows8, K] the normalised rows; weights: [N_i, K] each, the last one's rows possibly fewer than its
    rounded width (``plan.last_padding``). Returns ``concat([h @ w.T for w in weights], -1)`` [rows8, sum of the
    rounded widths] in h's dtype, each projection's fp32 sum rounded to it; the columns past a narrow last
    projection's rows hold anything."""
    R, N, blocks = plan.rows, plan.tile, plan.blocks
    dtype = h.dtype
    starts = [sum(plan.widths[:j]) // N for j in range(len(plan.widths))]  # each projection's first CTA
    narrow = plan.last_padding > 0
    narrow_rows = plan.widths[-1] - plan.last_padding  # the narrow weight's rows

    def load_narrow_tile(w_gmem, t, w_smem, w_ready, stage_smem, stage_ready):
        """Tile ``t`` of a narrow last projection. TMA reads a swizzled tile only from an array whose tiled
        dimensions are whole tiles (jax 0.11.2), so the tile's weight rows land in plain SMEM and are copied from
        there into the first ``plan.stage_rows`` rows of the swizzled B operand blocks; the copy stands in for the
        TMA's arrival on ``w_ready``. The operand's rows past the weight's are left as they are: they only reach
        output columns past the projection's features, which the entry drops or its caller never reads."""
        valid = min(N, narrow_rows - t * N)
        S = plan.stage_rows
        for c in range(blocks):
            plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(t * N, valid), pl.ds(c * BLOCK_K, BLOCK_K)],
                                    stage_smem.at[c, pl.ds(0, valid)], stage_ready.at[c])
        for c in range(blocks):
            plgpu.barrier_wait(stage_ready.at[c])
            w_smem.at[c, pl.ds(0, S)][...] = plgpu.load(stage_smem.at[c], layout=STAGE_LAYOUT)
            plgpu.commit_smem()  # visible to wgmma (the async proxy) before it is signalled
            plgpu.barrier_arrive(w_ready.at[c])

    def tile(p, h_gmem, w_gmems, y_gmem, scratch):
        (a_smem, w_smem, y_smem, *stage_smem), (a_ready, w_ready, *stage_ready) = scratch
        # the rows first: every product needs them, and an SM's copies land roughly in issue order
        for c in range(blocks):
            plgpu.copy_gmem_to_smem(h_gmem.at[:, pl.ds(c * BLOCK_K, BLOCK_K)], a_smem.at[c, pl.ds(0, R)],
                                    a_ready.at[c])
        # the weight blocks of this CTA's features: one branch per projection (separate arrays)
        for j, w_gmem in enumerate(w_gmems):
            first, count = starts[j], plan.widths[j] // N
            if narrow and j == len(w_gmems) - 1:
                for t in range(count):
                    pl.when(p == first + t)(functools.partial(load_narrow_tile, w_gmem, t, w_smem, w_ready,
                                                              *stage_smem, *stage_ready))
                continue

            @pl.when((p >= first) & (p < first + count))
            def _(w_gmem=w_gmem, first=first):
                rows = pl.ds((p - first) * N, N)
                for c in range(blocks):
                    plgpu.copy_gmem_to_smem(w_gmem.at[rows, pl.ds(c * BLOCK_K, BLOCK_K)], w_smem.at[c],
                                            w_ready.at[c])

        y = rows_by_weight_blocks(a_smem, a_ready, w_smem, w_ready, blocks, N)
        y_smem[...] = y.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(y_smem.at[pl.ds(0, R)], y_gmem.at[:, pl.ds(p * N, N)])
        plgpu.wait_smem_to_gmem(0)

    def projections_body(h_gmem, *refs):
        *w_gmems, y_gmem = refs
        p = lax.axis_index("p")
        staging = ((), ())
        if narrow:
            staging = ((plgpu.SMEM((blocks, plan.stage_rows, BLOCK_K), dtype),), (plgpu.Barrier(num_barriers=blocks),))
        pl.run_scoped(
            lambda *s: tile(p, h_gmem, w_gmems, y_gmem, s),
            (plgpu.SMEM((blocks, M, BLOCK_K), dtype, transforms=_bf16_tiles()),
             plgpu.SMEM((blocks, N, BLOCK_K), dtype, transforms=_bf16_tiles()),
             plgpu.SMEM((M, N), dtype, transforms=_output_tiles(N)), *staging[0]),
            (plgpu.Barrier(num_barriers=blocks), plgpu.Barrier(num_barriers=blocks), *staging[1]),
        )

    # A narrow projection's staging copy needs explicit layouts (Lane semantics): the default Warpgroup
    # semantics' layout inference finds none for it. Without one the kernel keeps the default.
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane) if narrow else None
    return plgpu.kernel(projections_body, out_type=jax.ShapeDtypeStruct((R, sum(plan.widths)), dtype),
                        grid=(plan.ctas,), grid_names=("p",), compiler_params=params)(h, *weights)


def unsupported_reason(x, norm_weight, weights) -> str | None:
    """Why the kernel cannot take these arguments (None where it can, given a schedule)."""
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        return f"x must be [rows, hidden] bf16 (got {x.shape} {x.dtype})"
    hidden = x.shape[1]
    if norm_weight.shape != (hidden,) or any(w.ndim != 2 or w.shape[1] != hidden for w in weights):
        return f"weights must be [out, {hidden}] and the norm [{hidden}]"
    if any(w.dtype != x.dtype for w in (norm_weight, *weights)):
        return "weights must share x's dtype"
    return None


def plan_for(x, norm_weight, weights, sms: int | None = None) -> Schedule | None:
    """The schedule the entry runs for these arguments, or None where it falls back."""
    if x.ndim != 2 or x.shape[0] < MIN_ROWS or unsupported_reason(x, norm_weight, weights) is not None:
        return None
    return schedule(x.shape[0], x.shape[1], tuple(w.shape[0] for w in weights),
                    sms or jax.devices()[0].core_count)


def norm_projections(x, norm_weight, eps, weights, pad_columns: bool = False, *, sms: int | None = None):
    """Dispatch entry for "norm_projections" (``ops.decode_fused.norm_projections``: the projections of
    ``rmsnorm(x)`` side by side, x [rows, hidden]) with the projections in the kernel; the norm and the rows'
    padding to 8 before it are an XLA fusion. With ``pad_columns`` the kernel's output keeps a narrow last
    projection's padding columns (no copy to drop them). Shapes the kernel does not take, and fewer than
    ``MIN_ROWS`` rows, go to ``decode_gemv.norm_projections`` (its GEMV kernel at one or two rows, the jnp op
    elsewhere)."""
    weights = tuple(weights)
    plan = plan_for(x, norm_weight, weights, sms)
    if plan is None:
        return decode_gemv.norm_projections(x, norm_weight, eps, weights)
    rows = x.shape[0]
    h = rms_norm(jnp.pad(x, ((0, plan.rows - rows), (0, 0))), norm_weight, eps)
    y = projections(h, weights, plan=plan)
    return y[:rows] if pad_columns else y[:rows, : plan.features]
