"""The gated MLP's gate/up projections with the activation product, for 8-32 decode rows, as one Mosaic GPU kernel
(TMA weight streaming, wgmma with the rows as the N dimension). The jnp oracle is
``apriel2_jax.ops.decode_fused.norm_gated_mlp``; the entry runs the RMSNorm before the kernel in XLA.

Why. At a few rows the gate/up pair is the largest read of a decode layer (17.4 MB of the 0.5B geometry's 30 MB)
and little arithmetic. XLA runs it as a GEMM over the concatenated weights (its dot merger) and a second fusion
for the activation product; its Triton GEMMs at 8-32 rows stream without TMA at ~1.9 TB/s.

Design. CTA ``p`` owns intermediate features [64p, 64p + 64) of both projections, so each CTA streams the same
bytes (no tail wave) and the product needs nothing from another CTA; its store is the only write.
- It issues TMA loads of the normalised rows (padded to 8: the wgmma N dimension), then of its first (gate, up)
  weight block pairs ([64, 128] each, 256-byte rows), and refills that ring as the loop reads it. The weight
  blocks are the wgmma A operands, so few rows cost no padding to 64.
- It rounds the projections to the dtype, applies the activation in fp32, rounds and multiplies (as the oracle),
  and stores its [rows, 64] tile of the product with one TMA store.
- One CTA per 64 features: intermediate widths above 64 x the SM count are not taken (the entry falls back).

The same gate/up loop (``decode_mlp.gated_product_tile``) is the first phase of the whole-MLP kernel
(``decode_mlp``), which keeps the product in SMEM and adds its down-projection slice into the output with
reduce-add stores (in no fixed order, hence not registered); this kernel hands the product to XLA's down GEMM
instead, whose split-K sum has a fixed order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from apriel2_jax.ops.norms import rms_norm

from . import decode_gemv
from .decode_mlp import ACTIVATIONS, BLOCK_K, TILE, _bf16_tiles, gated_product_tile

MAX_ROWS = 32
MIN_ROWS = 8  # fewer rows: XLA's GEMV fusions, with the norm inside, or decode_gemv's kernel at one row. In the
# engine (0.5B, H200, 2026-11-27) the kernel took all-attention B=4 from 0.865 to 0.891 ms and B=2 from 0.790 to
# 0.835, and B=8 from 0.869-0.878 to 0.860-0.862; at one row (2026-11-29) from decode_gemv's 0.65 to 0.71
SMEM_BYTES = 220 * 1024  # of the 227 KB a Hopper CTA may use: headroom for barriers and Mosaic's scratch


@dataclasses.dataclass(frozen=True)
class Schedule:
    rows: int  # padded to 8
    hidden: int
    intermediate: int
    depth: int  # ring stages of (gate, up) block pairs

    @property
    def ctas(self) -> int:
        return self.intermediate // TILE

    def smem_bytes(self) -> int:
        """The rows, the (gate, up) stages and the product tile."""
        return self.rows * self.hidden * 2 + self.depth * 2 * TILE * BLOCK_K * 2 + self.rows * TILE * 2


def schedule(rows: int, hidden: int, intermediate: int, sms: int) -> Schedule | None:
    """The kernel's schedule for ``rows`` rows of a [hidden -> intermediate] gate/up pair on ``sms`` SMs, or None
    where it does not fit (hidden width not a multiple of 128, intermediate width not a multiple of 64 or above 64
    per SM, more than ``MAX_ROWS`` rows, SMEM). Plain Python: the entry decides with it at trace time."""
    if not 1 <= rows <= MAX_ROWS or hidden % BLOCK_K or intermediate % TILE or intermediate // TILE > sms:
        return None
    rows8 = -(-rows // 8) * 8
    blocks = hidden // BLOCK_K
    room = SMEM_BYTES - Schedule(rows8, hidden, intermediate, 0).smem_bytes()
    depth = min(blocks, room // (2 * TILE * BLOCK_K * 2))
    # the loop refills a stage one step after reading it: two stages at least, unless one holds every block
    if depth < min(2, blocks):
        return None
    return Schedule(rows8, hidden, intermediate, depth)


def gated_product(h: jax.Array, w_gate: jax.Array, w_up: jax.Array, *, act: str, plan: Schedule) -> jax.Array:
    """h: [rows8, hidden] the normalised rows; w_gate, w_up: [I, hidden]. Returns ``act(h @ w_gate.T) * (h @
    w_up.T)`` [rows8, I] in h's dtype, each projection and the activation rounded to it as the oracle does."""
    R, D = plan.rows, plan.hidden
    dtype = h.dtype
    blocks, depth = D // BLOCK_K, plan.depth
    bf16 = functools.partial(plgpu.SMEM, dtype=dtype, transforms=_bf16_tiles())

    def product_tile(p, h_gmem, wg_gmem, wu_gmem, y_gmem, scratch):
        (h_smem, w_smem, y_smem), (h_ready, w_ready) = scratch
        row0 = p * TILE
        # the rows first: an SM's copies land roughly in issue order, and the first product waits on them
        for c in range(blocks):
            plgpu.copy_gmem_to_smem(h_gmem.at[:, pl.ds(c * BLOCK_K, BLOCK_K)], h_smem.at[c], h_ready.at[c])

        gated_product_tile(row0, wg_gmem, wu_gmem, h_smem, h_ready, w_smem, w_ready, y_smem, act=act)
        plgpu.copy_smem_to_gmem(y_smem, y_gmem.at[:, pl.ds(row0, TILE)])
        plgpu.wait_smem_to_gmem(0)

    def gated_product_body(h_gmem, wg_gmem, wu_gmem, y_gmem):
        p = lax.axis_index("p")
        pl.run_scoped(
            lambda *s: product_tile(p, h_gmem, wg_gmem, wu_gmem, y_gmem, s),
            (bf16((blocks, R, BLOCK_K)), bf16((2, depth, TILE, BLOCK_K)), bf16((R, TILE))),
            (plgpu.Barrier(num_barriers=blocks), plgpu.Barrier(num_barriers=2 * depth)),
        )

    return plgpu.kernel(gated_product_body, out_type=jax.ShapeDtypeStruct((R, plan.intermediate), dtype),
                        grid=(plan.ctas,), grid_names=("p",))(h, w_gate, w_up)


def unsupported_reason(x, norm_weight, w_gate, w_up, act) -> str | None:
    """Why the kernel cannot take these arguments (None where it can, given a schedule)."""
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        return f"x must be [rows, hidden] bf16 (got {x.shape} {x.dtype})"
    rows, hidden = x.shape
    inter = w_gate.shape[0]
    if w_gate.shape != (inter, hidden) or w_up.shape != (inter, hidden) or norm_weight.shape != (hidden,):
        return "weights must be gate/up [I, hidden], norm [hidden]"
    if any(w.dtype != x.dtype for w in (norm_weight, w_gate, w_up)):
        return "weights must share x's dtype"
    if act not in ACTIVATIONS:
        return f"activation {act!r} not in {ACTIVATIONS}"
    return None


def plan_for(x, norm_weight, w_gate, w_up, act, sms: int | None = None) -> Schedule | None:
    """The schedule the entry runs for these arguments, or None where it falls back."""
    if x.ndim != 2 or x.shape[0] < MIN_ROWS or unsupported_reason(x, norm_weight, w_gate, w_up, act) is not None:
        return None
    return schedule(x.shape[0], x.shape[1], w_gate.shape[0], sms or jax.devices()[0].core_count)


def norm_gated_mlp(x, norm_weight, eps, w_gate, w_up, act, *, sms: int | None = None):
    """Dispatch entry for "norm_gated_mlp" (``ops.decode_fused.norm_gated_mlp``: ``act(gate(rmsnorm(x))) *
    up(rmsnorm(x))``, x [rows, hidden]) with the projections and the product in the kernel; the norm and the rows'
    padding to 8 before it are an XLA fusion. Shapes the kernel does not take, and fewer than ``MIN_ROWS`` rows,
    go to ``decode_gemv.norm_gated_mlp`` (its GEMV kernel at one row, the jnp op elsewhere)."""
    plan = plan_for(x, norm_weight, w_gate, w_up, act, sms)
    if plan is None:
        return decode_gemv.norm_gated_mlp(x, norm_weight, eps, w_gate, w_up, act)
    rows = x.shape[0]
    h = rms_norm(jnp.pad(x, ((0, plan.rows - rows), (0, 0))), norm_weight, eps)
    return gated_product(h, w_gate, w_up, act=act, plan=plan)[:rows]
