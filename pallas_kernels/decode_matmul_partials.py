"""The MLP's down projection added to the residual stream (``mlp_down_add``, ``matmul_add``'s name for that call
site) for 8-32 rows: the matmul as K-split float32 partials in one Mosaic GPU kernel (TMA weight streaming, wgmma with the rows as the N dimension), summed in a fixed
order and added to the residual by XLA. The jnp oracle is ``apriel2_jax.ops.decode_fused.matmul_add``.

Why. At a few rows a projection is a read of its weights and little arithmetic. XLA runs it as a Triton GEMM split
over its input, whose loads do not use TMA (the MLP's down projection, 8.7 MB at the 0.5B geometry, streams at
~1.2 TB/s at 32 rows), then a fusion summing the splits with the residual add (and the next norm where one follows).

Design. CTA (t, s) owns output features [64t, 64t + 64) over input blocks [s * chunk, (s + 1) * chunk) of 128
features: it issues TMA loads of the rows' blocks (padded to 8 rows: the wgmma N dimension) and of its weight
blocks ([64, 128], 256-byte rows) at once, multiplies each pair as it lands and stores its [64, rows] float32
partial with one TMA store. The splits give about four CTAs per SM, all resident at once (one wave); the last
split's blocks past the input width multiply zero rows. The partials' order of summation is XLA's reduction, the
same every call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import decode_gemv
from .decode_mlp import BLOCK_K, TILE, _bf16_tiles

F32 = jnp.float32
MAX_ROWS = 32
MIN_ROWS = 8  # fewer rows: decode_gemv's matmul_add kernel (one or two rows) or XLA's GEMV fusions
SM_SMEM_BYTES = 220 * 1024  # of the 228 KB of an SM's shared memory, shared by its resident CTAs
CTAS_PER_SM = 4  # the grid's target size: four CTAs per SM, resident together


@dataclasses.dataclass(frozen=True)
class Schedule:
    rows: int  # padded to 8
    inputs: int  # K
    outputs: int  # N
    chunk: int  # input blocks of 128 per CTA; the last split's blocks past K read zero rows

    @property
    def blocks(self) -> int:
        return self.inputs // BLOCK_K

    @property
    def tiles(self) -> int:
        return self.outputs // TILE

    @property
    def splits(self) -> int:
        return -(-self.blocks // self.chunk)

    @property
    def ctas(self) -> int:
        return self.tiles * self.splits

    def smem_bytes(self) -> int:
        """The rows' blocks, the weight blocks and the float32 partial."""
        return self.chunk * BLOCK_K * 2 * (self.rows + TILE) + TILE * self.rows * 4


def schedule(rows: int, inputs: int, outputs: int, sms: int, ctas_per_sm: int | None = None) -> Schedule | None:
    """The kernel's schedule for ``rows`` rows of an [inputs -> outputs] projection on ``sms`` SMs, or None where it
    does not fit (input width not a multiple of 128, output width not a multiple of 64, more than ``MAX_ROWS``
    rows, SMEM). The input splits: as many as give at most ``ctas_per_sm`` (default ``CTAS_PER_SM``) CTAs per SM,
    then the fewest with the same chunk. Plain Python: the entry decides with it at trace time."""
    if not 1 <= rows <= MAX_ROWS or inputs % BLOCK_K or outputs % TILE or not inputs or not outputs:
        return None
    rows8 = -(-rows // 8) * 8
    per_sm = ctas_per_sm or CTAS_PER_SM
    blocks, tiles = inputs // BLOCK_K, outputs // TILE
    splits = max(1, min(blocks, sms * per_sm // tiles))
    plan = Schedule(rows8, inputs, outputs, -(-blocks // splits))
    if plan.ctas > sms * (SM_SMEM_BYTES // plan.smem_bytes()):  # every CTA resident at once, or not taken
        return None
    return plan


def matmul_partials(x: jax.Array, weight: jax.Array, *, plan: Schedule) -> jax.Array:
    """x: [rows8, splits * chunk * 128] (zero past K); weight: [N, K]. Returns the float32 partials [splits, N,
    rows8] of ``weight @ x.T``, split over K."""
    R, chunk = plan.rows, plan.chunk
    bf16 = functools.partial(plgpu.SMEM, dtype=x.dtype, transforms=_bf16_tiles())
    part_swizzle = plgpu.find_swizzle(R * 32)
    part_tf = (plgpu.TilingTransform((8, part_swizzle // 4)), plgpu.SwizzleTransform(part_swizzle))

    def partial_tile(t, s, x_gmem, w_gmem, out_gmem, scratch):
        (x_smem, w_smem, out_smem), (ready,) = scratch
        for i in range(chunk):  # every load at once: a CTA's bytes are a few blocks
            block = s * chunk + i
            # x is zero past K; the weights' block index stays in bounds (a block read again, from L2)
            plgpu.copy_gmem_to_smem(x_gmem.at[:, pl.ds(block * BLOCK_K, BLOCK_K)], x_smem.at[i], ready.at[i])
            w_cols = pl.ds(jnp.minimum(block, plan.blocks - 1) * BLOCK_K, BLOCK_K)
            plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(t * TILE, TILE), w_cols], w_smem.at[i], ready.at[chunk + i])

        def accumulate(acc):
            for i in range(chunk):
                plgpu.barrier_wait(ready.at[i])
                plgpu.barrier_wait(ready.at[chunk + i])
                plgpu.wgmma(acc, w_smem.at[i], x_smem.at[i].transpose((1, 0)))
            plgpu.wgmma_wait(0)
            return acc[...]

        out_smem[...] = pl.run_scoped(accumulate, plgpu.ACC((TILE, R), F32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[s, pl.ds(t * TILE, TILE)])
        plgpu.wait_smem_to_gmem(0)

    def body(x_gmem, w_gmem, out_gmem):
        # tiles vary fastest: the CTAs of one input chunk run side by side and share the rows' blocks in L2
        t, s = lax.axis_index("t"), lax.axis_index("s")
        pl.run_scoped(
            lambda *scratch: partial_tile(t, s, x_gmem, w_gmem, out_gmem, scratch),
            (bf16((chunk, R, BLOCK_K)), bf16((chunk, TILE, BLOCK_K)), plgpu.SMEM((TILE, R), F32, transforms=part_tf)),
            (plgpu.Barrier(num_barriers=2 * chunk),),
        )

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((plan.splits, plan.outputs, R), F32),
                        grid=(plan.tiles, plan.splits), grid_names=("t", "s"))(x, weight)


def plan_for(x, weight, residual, sms: int | None = None) -> Schedule | None:
    """The schedule the entry runs for these arguments, or None where it falls back."""
    if x.ndim != 2 or weight.ndim != 2 or residual.ndim != 2 or x.dtype != jnp.bfloat16:
        return None
    rows, inputs = x.shape
    if rows < MIN_ROWS or weight.shape[1] != inputs or residual.shape != (rows, weight.shape[0]):
        return None
    if weight.dtype != x.dtype or residual.dtype != x.dtype:
        return None
    return schedule(rows, inputs, weight.shape[0], sms or jax.devices()[0].core_count)


def matmul_add(x, weight, residual, *, sms: int | None = None):
    """Dispatch entry for "mlp_down_add" (``ops.decode_fused.matmul_add``: ``residual + x @ weight.T``, the projection
    rounded to the dtype before the add). From ``MIN_ROWS`` rows the kernel computes the partials and XLA sums them,
    rounds and adds; other shapes and fewer rows go to ``decode_gemv.matmul_add`` (its GEMV kernel at one or two
    rows, the jnp op elsewhere)."""
    plan = plan_for(x, weight, residual, sms)
    if plan is None:
        return decode_gemv.matmul_add(x, weight, residual)
    rows = x.shape[0]
    padded = jnp.pad(x, ((0, plan.rows - rows), (0, plan.splits * plan.chunk * BLOCK_K - x.shape[1])))
    parts = matmul_partials(padded, weight, plan=plan)
    return residual + jnp.sum(parts, axis=0)[:, :rows].T.astype(x.dtype)
