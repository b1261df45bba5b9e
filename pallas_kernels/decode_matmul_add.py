"""A projection with the residual add (``residual + x @ w.T``) for 8-32 decode rows as one Mosaic GPU kernel: split
over the input width across the CTAs of a cluster, the partial sums added in a fixed order through distributed
shared memory. The dispatch entry takes it for projections whose input is wider than their output (the MLP's down
projection); the output projection stays XLA's (``plan_for`` says why). The jnp oracle is
``apriel2_jax.ops.decode_fused.matmul_add``.

Why. At a few rows the down projection is a weight stream with little arithmetic (8.7 MB at the 0.5B geometry).
Its output is narrow (896 features) and its input wide (4864), so one CTA per tile of output features over the
whole input would leave most SMs idle and each busy one streaming far more than its share. XLA splits the input
16 ways instead and sums the float32 partials in a second fusion that also adds the residual: ~8.5 µs per layer
at 32 rows (H200), where its bytes stream in ~2.5. A reduction across CTAs in no fixed order (float32 atomic or
TMA reduce-add stores, as the unregistered ``decode_mlp``) would make decode outputs vary between runs by a
rounding.

Design. A cluster of ``S`` CTAs (8 at most, the portable cluster size) owns 64 output features; CTA ``s`` of it
owns one contiguous share of the input's [*, 128] blocks (38 blocks at 4864 split 5,5,5,5,5,5,4,4).
- Each CTA issues every load at once: the rows' blocks into the first rows of [64, 128] A operand blocks (rows
  past them are never written; their products land in accumulator rows that are never read), its [64, 128]
  weight blocks (the transposed B operands: the checkpoint's [out, in] rows, 256-byte rows), and the residual's
  [rows, 64] tile. A CTA with fewer blocks than the cluster's widest share loads a block of zeros in place of the
  rows for its last slot, so every CTA runs the same loop with no branch around a wgmma.
- It multiplies block by block as they land and stores its float32 [64, 64] partial in its own SMEM.
- A hardware cluster barrier (``barrier.cluster`` arrive with release, wait with acquire: the order that makes
  the partials' SMEM stores visible to the other CTAs' reads) separates the partials from their sum.
- Each CTA then sums pairs of rows of all ``S`` partials, reading them from its peers' SMEM in cluster order
  (``s = 0 .. S-1``: a fixed order, so the result is the same every call), rounds the sum to the dtype (the
  projection, as ``Linear``), adds the residual in float32 and rounds (as the oracle), and TMA-stores its rows.
- A second cluster barrier keeps every CTA's SMEM alive until its peers have read it.

Not run by Mosaic GPU's interpreter (it has no distributed shared memory): the CPU tests cross-lower the kernel
for CUDA, and its numerics are checked on the GPU (``tests/pallas_kernels/test_decode_matmul_add.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import decode_gemv
from .decode_mlp import BLOCK_K, _bf16_tiles
from .decode_projections import M, rows_by_weight_blocks

F32 = jnp.float32
TILE = 64  # output features per cluster (wgmma's N)
MAX_CLUSTER = 8  # the portable cluster size
MAX_ROWS = 32
MIN_ROWS = 8  # fewer rows: decode_gemv's kernel (one or two rows) or XLA's GEMV fusions; this kernel at one row took
# the all-attention B=1 step from 0.64 to 0.76 ms (0.5B, H200, 2026-11-29)
PAIR_LAYOUT = plgpu.Layout.WG_STRIDED((2, TILE), vec_size=1)  # two rows of a tile: one element per thread
SMEM_BYTES = 220 * 1024  # of the 227 KB a Hopper CTA may use: headroom for barriers and Mosaic's scratch


@dataclasses.dataclass(frozen=True)
class Schedule:
    rows: int  # padded to 8
    k_dim: int
    n_dim: int
    cluster: int  # CTAs splitting one tile's input width

    @property
    def blocks(self) -> int:
        return self.k_dim // BLOCK_K

    @property
    def slots(self) -> int:
        """Blocks of the widest share: every CTA's loop length."""
        return -(-self.blocks // self.cluster)

    @property
    def ctas(self) -> int:
        return self.n_dim // TILE * self.cluster

    def share(self, s):
        """(first block, block count) of CTA ``s`` (an int, or the kernel's cluster index): the first ``blocks %
        cluster`` CTAs take one more."""
        base, extra = divmod(self.blocks, self.cluster)
        return s * base + jnp.minimum(s, extra), base + jnp.asarray(s < extra, jnp.int32)

    def smem_bytes(self) -> int:
        """The slots of rows (padded to M) and weights, the float32 partial, the residual and output tiles."""
        return self.slots * (M + TILE) * BLOCK_K * 2 + M * TILE * 4 + 2 * self.rows * TILE * 2


def schedule(rows: int, k_dim: int, n_dim: int, sms: int) -> Schedule | None:
    """The kernel's schedule for ``rows`` rows of a [k_dim -> n_dim] projection on ``sms`` SMs, or None where it
    does not fit: more than ``MAX_ROWS`` rows, an input width not a multiple of 128, an output width not a
    multiple of 64, or shares too wide for the SMEM. The cluster is the largest power of two up to
    ``MAX_CLUSTER`` that gives every CTA a block and keeps the CTAs within the SMs. Plain Python: the entry decides
    with it at trace time."""
    if not 1 <= rows <= MAX_ROWS or k_dim % BLOCK_K or n_dim % TILE or k_dim < BLOCK_K:
        return None
    rows8 = -(-rows // 8) * 8
    blocks, tiles = k_dim // BLOCK_K, n_dim // TILE
    cluster = MAX_CLUSTER
    while cluster > 1 and (cluster > blocks or tiles * cluster > sms):
        cluster //= 2
    plan = Schedule(rows8, k_dim, n_dim, cluster)
    if tiles * cluster > sms or plan.smem_bytes() > SMEM_BYTES:
        return None
    return plan


@plgpu.inline_mgpu()
def _cluster_sync(ctx):
    """Every thread of the cluster's CTAs: SMEM stores before it are visible to the cluster's reads after it
    (``barrier.cluster.arrive`` has release semantics and ``wait`` acquire by default)."""
    del ctx
    mgpu_utils.inline_ptx("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;", convergent=True)


def matmul_add_kernel(x: jax.Array, weight: jax.Array, residual: jax.Array, *, plan: Schedule) -> jax.Array:
    """x: [rows8, K]; weight: [N, K]; residual: [rows8, N]. Returns ``residual + x @ weight.T`` [rows8, N] in x's
    dtype, the projection's float32 sum rounded to it before the add (as the oracle)."""
    R, S, slots = plan.rows, plan.cluster, plan.slots
    dtype = x.dtype
    zeros = jnp.zeros((R, BLOCK_K), dtype)  # the rows' stand-in for a short share's last slot
    pairs = R // 2

    def tile(n, s, x_gmem, w_gmem, r_gmem, z_gmem, y_gmem, scratch):
        (a_smem, w_smem, part_smem, r_smem, y_smem), (a_ready, w_ready, r_ready) = scratch
        first, count = plan.share(s)
        base = plan.blocks // S  # the blocks every CTA has
        cols = pl.ds(n * TILE, TILE)
        # the rows first: every product needs them, and an SM's copies land roughly in issue order
        for j in range(slots):
            block = pl.ds((first + j) * BLOCK_K, BLOCK_K)
            if j < base:
                plgpu.copy_gmem_to_smem(x_gmem.at[:, block], a_smem.at[j, pl.ds(0, R)], a_ready.at[j])
            else:  # only the first ``extra`` CTAs have this block; the others multiply zeros by their first block
                @pl.when(j < count)
                def _(j=j, block=block):
                    plgpu.copy_gmem_to_smem(x_gmem.at[:, block], a_smem.at[j, pl.ds(0, R)], a_ready.at[j])

                @pl.when(j >= count)
                def _(j=j):
                    plgpu.copy_gmem_to_smem(z_gmem, a_smem.at[j, pl.ds(0, R)], a_ready.at[j])
        for j in range(slots):
            block = pl.ds(jnp.where(j < count, first + j, first) * BLOCK_K, BLOCK_K)
            plgpu.copy_gmem_to_smem(w_gmem.at[cols, block], w_smem.at[j], w_ready.at[j])
        plgpu.copy_gmem_to_smem(r_gmem.at[:, cols], r_smem, r_ready.at[0])

        part_smem[...] = rows_by_weight_blocks(a_smem, a_ready, w_smem, w_ready, slots, TILE)
        _cluster_sync()
        plgpu.barrier_wait(r_ready.at[0])
        for p in range(pairs):
            @pl.when(s == p % S)
            def _(p=p):
                rows = pl.ds(2 * p, 2)
                total = plgpu.load(plgpu.cluster_ref(part_smem.at[rows], {"s": 0}), layout=PAIR_LAYOUT)
                for peer in range(1, S):
                    peer_rows = plgpu.cluster_ref(part_smem.at[rows], {"s": peer})
                    total = total + plgpu.load(peer_rows, layout=PAIR_LAYOUT)
                res = plgpu.load(r_smem.at[rows], layout=PAIR_LAYOUT)
                y = total.astype(dtype).astype(F32) + res.astype(F32)
                y_smem.at[rows][...] = y.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(y_smem.at[rows], y_gmem.at[rows, cols])

        plgpu.wait_smem_to_gmem(0)
        _cluster_sync()  # the peers have read this CTA's partial

    def matmul_add_body(x_gmem, w_gmem, r_gmem, z_gmem, y_gmem):
        n, s = lax.axis_index("n"), lax.axis_index("s")
        pl.run_scoped(
            lambda *scratch: tile(n, s, x_gmem, w_gmem, r_gmem, z_gmem, y_gmem, scratch),
            (plgpu.SMEM((slots, M, BLOCK_K), dtype, transforms=_bf16_tiles()),
             plgpu.SMEM((slots, TILE, BLOCK_K), dtype, transforms=_bf16_tiles()),
             plgpu.SMEM((M, TILE), F32),
             plgpu.SMEM((R, TILE), dtype),
             plgpu.SMEM((R, TILE), dtype)),
            (plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=1)),
        )

    return plgpu.kernel(matmul_add_body, out_type=jax.ShapeDtypeStruct((R, plan.n_dim), dtype),
                        grid=(plan.n_dim // TILE,),
                        grid_names=("n",), cluster=(S,), cluster_names=("s",),
                        # explicit layouts: the Warpgroup semantics' lowering of a peer's sliced SMEM ref fails
                        # (a memref offset mismatch, jax 0.11.2)
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
                        )(x, weight, residual, zeros)


def unsupported_reason(x, weight, residual) -> str | None:
    """Why the kernel cannot take these arguments (None where it can, given a schedule)."""
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        return f"x must be [rows, K] bf16 (got {x.shape} {x.dtype})"
    rows, k_dim = x.shape
    if weight.ndim != 2 or weight.shape[1] != k_dim:
        return f"weight must be [N, {k_dim}] (got {weight.shape})"
    if residual.shape != (rows, weight.shape[0]):
        return f"residual must be [{rows}, {weight.shape[0]}] (got {residual.shape})"
    if weight.dtype != x.dtype or residual.dtype != x.dtype:
        return "weight and residual must share x's dtype"
    return None


def plan_for(x, weight, residual, sms: int | None = None) -> Schedule | None:
    """The schedule the entry runs for these arguments, or None where it falls back (also where the input is not
    wider than the output: the MLP's down projection)."""
    if x.ndim != 2 or x.shape[0] < MIN_ROWS or unsupported_reason(x, weight, residual) is not None:
        return None
    if x.shape[1] <= weight.shape[0]:
        # The output projection (square) stays XLA's, whose split sum also adds the residual (the next norm is a
        # fusion of its own either way), because it measured faster. In the engine (0.5B, H200, 2026-11-28) the kernel
        # on both projections took all-attention B=32 from 1.007, 0.997 to 1.004, 0.992 ms; on the down
        # projection alone to 0.974, 0.972 (against 0.997, 0.998). On an H100 (2026-11-28) the output projection
        # on the kernel too was slower: all-attention B=32 1.124, 1.115 against 1.099, 1.093
        return None
    return schedule(x.shape[0], x.shape[1], weight.shape[0], sms or jax.devices()[0].core_count)


def matmul_add(x, weight, residual, *, sms: int | None = None):
    """Dispatch entry for "matmul_add" (``ops.decode_fused.matmul_add``: ``residual + x @ weight.T``, x [rows, K])
    with the kernel from ``MIN_ROWS`` rows where the input is wider than the output; the rows' padding to 8 is an
    XLA pad. Shapes the kernel does not take, and fewer rows, go to ``decode_gemv.matmul_add`` (its GEMV kernel at
    one or two rows, the jnp op elsewhere)."""
    plan = plan_for(x, weight, residual, sms)
    if plan is None:
        return decode_gemv.matmul_add(x, weight, residual)
    rows = x.shape[0]
    pad = ((0, plan.rows - rows), (0, 0))
    return matmul_add_kernel(jnp.pad(x, pad), weight, jnp.pad(residual, pad), plan=plan)[:rows]

