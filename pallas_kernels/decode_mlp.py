"""The gated MLP of a decode step for up to 32 rows as one persistent Mosaic GPU kernel: gate/up projections with
the activation product and the down projection, one CTA per 64 intermediate features. The entry adds the RMSNorm
before it and the residual add after it. The jnp oracle is ``apriel2_jax.ops.decode_fused.gated_mlp_residual``.

Why. At a few rows the MLP reads its three matrices once (26 MB of the 0.5B geometry's 30 MB per layer) and does
little arithmetic, so its floor is bytes over bandwidth. XLA runs it as four kernels at 8-32 rows (gate/up GEMM,
activation product, down GEMM split over its input, the split sum with the residual add), each paying a start, a
first-load latency and a tail, with the intermediate product going through HBM.

Design. CTA ``p + 1`` owns intermediate features [64p, 64p + 64).
- It issues TMA loads of the normalised rows, then of its first (gate, up) weight block pairs ([64, 128] each),
  and refills that ring as the loop reads it. The rows (padded to 8) are the wgmma N dimension and the weight
  blocks the A operands, so few rows cost no padding to 64.
- It rounds the products, applies the activation in fp32, rounds and multiplies (as the reference), and keeps its
  [64, rows] product tile in SMEM.
- Its down-projection blocks (the [128 output features, 64] blocks of ``w_down``'s columns for its features) are
  issued at the loop step that issues the last (gate, up) pair. An SM's copies land in issue order, so down loads
  issued earlier would hold back the gate/up refills.
- It multiplies the down blocks by the product tile, two blocks per wgmma at 8 rows and one above (the
  accumulator's registers). It adds each float32 result into the output with a TMA reduce-add store from SMEM
  that the gate/up stages held. There is no grid-wide dependence on the product, which never leaves the SM.
- CTA 0 zeroes the output first. The others wait for it (a global counter) before their first add, after their
  first product, by when it is long done.

The RMSNorm runs in XLA before the kernel (``ops.norms.rms_norm``), where the engine fuses it into the fusion
before the MLP (the attention output's split sum and residual add). The caller rounds the sum to the dtype (the
projection) and adds it to the residual (rounded), as the reference. The float32 adds of the 76 CTAs (0.5B) land
in no fixed order, so outputs can differ between calls by a rounding of the sum (bf16 ulps of the projection,
rarely).

Status: equal to the bf16 jnp chain on the GPU (2-32 rows; ``tests/pallas_kernels/test_decode_mlp.py`` checks it
where a GPU is present). Its gate/up phase alone, with the product written out for XLA's down GEMM, is the
registered ``decode_gated_product`` kernel. Not registered: in the engine it takes ~2% off the B=8 and B=32 steps
(``bench_generate.py --decode-mlp-kernel``), and its reduce-add order makes decode outputs vary between runs.
Figures are in docs/BENCHMARKS.md ("Tried and not taken: the whole gated MLP as one persistent Mosaic GPU kernel").
What bounds it, from its per-CTA trace (``profile_dir``):
- each feature CTA streams 341 KB (229 KB of gate/up, 112 KB of down);
- the [128, 64] down blocks have 128-byte rows, which TMA streams slower than the 256-byte rows of the gate/up
  blocks (76 CTAs: 2.9 against 3.5 TB/s);
- the SMEM cannot hold a CTA's down blocks beside enough (gate, up) stages.
Using 76 of the 132 SMs is not the bound: 76 CTAs stream as fast as 132.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from apriel2_jax import dispatch
from apriel2_jax.ops.norms import rms_norm

F32 = jnp.float32
TILE = 64  # wgmma's M: weight rows per tile, and the intermediate features of one CTA
BLOCK_K = 128  # input width of the gate/up loads: [64, 128] bf16 blocks (16 KB), 256-byte rows. With 128-byte rows
# ([64, 64] blocks) 76 CTAs streamed 17.4 MB at 2.8 TB/s against 3.7 (H200, 2026-11-25)
MAX_ROWS = 32
MIN_ROWS = 2  # one row takes the dispatched norm_gated_mlp and matmul_add (decode_gemv's kernels on the GPU)
SMEM_BYTES = 220 * 1024  # of the 227 KB a Hopper CTA may use: headroom for barriers and Mosaic's scratch
DOWN_DEPTH = 4  # ring stages of [128, 64] down blocks; the rest of the SMEM goes to (gate, up) stages
DOWN_ISSUE_STEP = None  # the gate/up step before which the first down loads are issued (0: before the loop; None:
# after the last gate/up load, as an SM's copies land in issue order: 8 rows 14.24 -> 13.60 µs per layer, 32 rows
# 17.56-17.80 -> 16.82, 0.5B, H200, 2026-11-27)
GROUP_REGS = 16  # float32 accumulator registers per thread for one wgmma over several down blocks: two blocks at
# 8 rows (13.60 µs per layer against 13.95 for one and 14.04 for four), one from 16 rows (32 rows: 16.82 against 17.28
# for two), same measurement
_SWIZZLE = 128  # bytes of a 64-element bf16 row: the swizzle of the 64-column tiles of every bf16 SMEM block
ACTIVATIONS = ("silu", "sigmoid", "relu", "gelu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """CTA 0 zeroes the output; CTAs 1..``gate_up_ctas`` each own 64 intermediate features."""

    rows: int  # padded to 8
    hidden: int
    intermediate: int
    gate_up_depth: int  # ring stages of (gate, up) block pairs
    down_depth: int  # ring stages of down blocks (two 64-feature output tiles each)
    down_issue_step: int = 0  # the gate/up step before which the first down loads are issued

    @property
    def down_blocks(self) -> int:
        return self.hidden // (2 * TILE)

    @property
    def gate_up_ctas(self) -> int:
        return self.intermediate // TILE

    @property
    def programs(self) -> int:
        return self.gate_up_ctas + 1

    @property
    def out_depth(self) -> int:
        """float32 output blocks of the down loop (each [128, rows], stored by a TMA reduce-add): as many as the
        (gate, up) stages' bytes hold, up to one per down block, at least two."""
        block = 2 * TILE * self.rows * 4
        return max(2, min(self.down_blocks, self.gate_up_depth * 2 * TILE * BLOCK_K * 2 // block))

    @property
    def down_group(self) -> int:
        """Down blocks multiplied by one wgmma (one accumulator, one wait, one store to SMEM): at most
        ``GROUP_REGS`` accumulator registers per thread, and groups that never wrap the down ring or the output
        blocks."""
        def fits(n, depth):
            return depth >= self.down_blocks or depth % n == 0
        return max(n for n in range(1, self.down_depth + 1)
                   if n == 1 or (n * self.rows <= GROUP_REGS and fits(n, self.down_depth) and fits(n, self.out_depth)))

    def smem_bytes(self) -> int:
        """What a feature CTA allocates: the rows, the product tile and the down stages for the whole kernel; the
        (gate, up) stages during gate/up, then in the same bytes the down loop's float32 output blocks."""
        fixed = self.rows * self.hidden * 2 + self.rows * TILE * 2 + self.down_depth * 2 * TILE * TILE * 2
        return fixed + max(self.gate_up_depth * 2 * TILE * BLOCK_K * 2, self.out_depth * 2 * TILE * self.rows * 4)


def schedule(rows: int, hidden: int, intermediate: int, sms: int, down_depth: int | None = None) -> Schedule | None:
    """The kernel's schedule for ``rows`` rows of a [hidden -> intermediate -> hidden] MLP on ``sms`` SMs, or None
    where it does not fit (hidden width not a multiple of 128 or wider than 256 such blocks, intermediate width not
    a multiple of 64, more than ``MAX_ROWS`` rows, more CTAs than SMs, SMEM). ``down_depth``: the most down stages
    (at most the CTA's hidden / 128 blocks; default ``DOWN_DEPTH``). Plain Python: the entry decides with it at trace time."""
    if not 1 <= rows <= MAX_ROWS or hidden % BLOCK_K or hidden // BLOCK_K > 256 or intermediate % TILE:
        return None
    rows8 = -(-rows // 8) * 8
    if intermediate // TILE + 1 > sms:
        return None
    # the gate/up loop refills a stage one step after reading it, so it needs two stages (or one block in all):
    # give down stages back until they fit
    for dd in range(min(hidden // (2 * TILE), down_depth or DOWN_DEPTH), 0, -1):
        room = SMEM_BYTES - Schedule(rows8, hidden, intermediate, 0, dd).smem_bytes() + 2 * 2 * TILE * rows8 * 4
        gate_up_depth = min(hidden // BLOCK_K, room // (2 * TILE * BLOCK_K * 2))
        last_gate_up_issue = max(hidden // BLOCK_K - gate_up_depth, 0)  # the step that issues the last (gate, up) pair
        issue_at = last_gate_up_issue if DOWN_ISSUE_STEP is None else min(DOWN_ISSUE_STEP, hidden // BLOCK_K - 1)
        plan = Schedule(rows8, hidden, intermediate, gate_up_depth, dd, issue_at)
        if gate_up_depth >= min(2, hidden // BLOCK_K) and plan.smem_bytes() <= SMEM_BYTES:
            return plan
    return None


def _activation(name: str, g: jax.Array) -> jax.Array:
    """fp32 activations from primitives Mosaic GPU lowers (the oracle's ``jax.nn`` forms, to fp32 rounding)."""
    if name == "silu":
        return g / (1.0 + jnp.exp(-g))
    if name == "sigmoid":
        return 1.0 / (1.0 + jnp.exp(-g))
    if name == "relu":
        return jnp.maximum(g, 0.0)
    if name == "gelu":
        return 0.5 * g * (1.0 + lax.erf(g * 0.7071067811865476))
    if name == "gelu_pytorch_tanh":
        return 0.5 * g * (1.0 + jnp.tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    raise ValueError(f"unsupported activation {name!r}; expected one of {ACTIVATIONS}")


def _bf16_tiles():
    return (plgpu.TilingTransform((8, _SWIZZLE // 2)), plgpu.SwizzleTransform(_SWIZZLE))


def gated_product_tile(row0, wg_gmem, wu_gmem, h_smem, h_ready, w_smem, w_ready, y_smem, *, act: str,
                       extra_loads=None) -> None:
    """One CTA's [rows, 64] tile of ``act(h @ w_gate.T) * (h @ w_up.T)`` (features [row0, row0 + 64)) into
    ``y_smem`` [rows, 64], committed for TMA or wgmma reads. The rows' blocks ``h_smem`` [blocks, rows, 128] arrive
    on ``h_ready`` (loads the caller issued); this issues the (gate, up) weight blocks ([64, 128]) into the ring
    ``w_smem`` [2, depth, 64, 128] (barriers ``w_ready``: gate stages, then up stages) and refills a stage one step
    after reading it. Each projection is rounded to the dtype, the activation taken in fp32 and rounded, and the
    product rounded, as the oracle. ``extra_loads`` = (step, issue): ``issue()`` runs at that loop step (0: after
    the first stages' loads), behind the (gate, up) loads issued by then: an SM's copies land in issue order."""
    blocks, depth = h_smem.shape[0], w_smem.shape[1]
    rows = h_smem.shape[1]
    dtype = h_smem.dtype

    def issue(step):
        slot = step % depth
        cols = pl.ds(step * BLOCK_K, BLOCK_K)
        plgpu.copy_gmem_to_smem(wg_gmem.at[pl.ds(row0, TILE), cols], w_smem.at[0, slot], w_ready.at[slot])
        plgpu.copy_gmem_to_smem(wu_gmem.at[pl.ds(row0, TILE), cols], w_smem.at[1, slot], w_ready.at[depth + slot])

    for step in range(depth):
        issue(step)
    if extra_loads is not None and extra_loads[0] == 0:
        extra_loads[1]()

    def accumulate(acc_g, acc_u):
        def step_fn(step, _):
            slot = step % depth
            plgpu.barrier_wait(h_ready.at[step])
            plgpu.barrier_wait(w_ready.at[slot])
            plgpu.barrier_wait(w_ready.at[depth + slot])
            rhs = h_smem.at[step].transpose((1, 0))
            plgpu.wgmma(acc_g, w_smem.at[0, slot], rhs)
            plgpu.wgmma(acc_u, w_smem.at[1, slot], rhs)
            plgpu.wgmma_wait(2)  # the previous step's pair is done: its stage can be refilled

            @pl.when((step > 0) & (step - 1 + depth < blocks))
            def _():
                issue(step - 1 + depth)

            if extra_loads is not None and extra_loads[0] > 0:
                @pl.when(step == extra_loads[0])
                def _():
                    extra_loads[1]()

        lax.fori_loop(0, blocks, step_fn, None)
        plgpu.wgmma_wait(0)
        return acc_g[...], acc_u[...]

    g, u = pl.run_scoped(accumulate, plgpu.ACC((TILE, rows), F32), plgpu.ACC((TILE, rows), F32))
    g = g.astype(dtype).astype(F32)
    u = u.astype(dtype).astype(F32)
    y = (_activation(act, g).astype(dtype).astype(F32) * u).astype(dtype)
    y_smem.transpose((1, 0))[...] = plgpu.layout_cast(y, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()


def gated_mlp_sum(h, w_gate, w_up, w_down, *, act: str, plan: Schedule, profile_dir: str | None = None) -> jax.Array:
    """h: [rows8, hidden] the normalised rows (bf16); w_gate, w_up [I, hidden]; w_down [hidden, I]. Returns the down
    projection of ``act(gate(h)) * up(h)`` in float32, transposed: [hidden, rows8]. ``profile_dir``: write Mosaic
    GPU's trace of each CTA's phases there (a JSON file per call)."""
    R, D = plan.rows, plan.hidden
    dtype = h.dtype
    d_blocks, out_tiles, down_blocks = D // BLOCK_K, D // TILE, plan.down_blocks
    gd, dd, od, ctas = plan.gate_up_depth, plan.down_depth, plan.out_depth, plan.gate_up_ctas
    group, issue_at = plan.down_group, plan.down_issue_step
    blk = 2 * TILE  # output features per down block
    part_swizzle = plgpu.find_swizzle(R * 32)
    part_tf = (plgpu.TilingTransform((8, part_swizzle // 4)), plgpu.SwizzleTransform(part_swizzle))
    bf16 = functools.partial(plgpu.SMEM, dtype=dtype, transforms=_bf16_tiles())

    def gate_up_down(p, h_gmem, wg_gmem, wu_gmem, wd_gmem, acc_gmem, counter, scratch):
        (h_smem, wd_smem, y_smem), (h_ready, w_ready, wd_ready) = scratch
        row0 = p * TILE

        def issue_down(j):  # output features [128j, 128j + 128) of this CTA's 64 columns of w_down
            plgpu.copy_gmem_to_smem(wd_gmem.at[pl.ds(j * blk, blk), pl.ds(row0, TILE)],
                                    wd_smem.at[pl.ds((j % dd) * blk, blk)], wd_ready.at[j % dd])

        # the rows first: an SM's copies land roughly in issue order, and the first product waits on them
        for c in range(d_blocks):
            plgpu.copy_gmem_to_smem(h_gmem.at[:, pl.ds(c * BLOCK_K, BLOCK_K)], h_smem.at[c], h_ready.at[c])

        def gate_up(w_smem):
            def issue_downs():
                for j in range(dd):
                    issue_down(j)

            gated_product_tile(row0, wg_gmem, wu_gmem, h_smem, h_ready, w_smem, w_ready, y_smem, act=act,
                               extra_loads=(issue_at, issue_downs))

        with jax.named_scope("gate_up"):
            pl.run_scoped(gate_up, bf16((2, gd, TILE, BLOCK_K)))

        def down(out_smem):  # in the bytes the (gate, up) stages held: their loads have landed and been read
            def down_group(j, m):  # blocks j .. j + m - 1: one wgmma, one wait, one store to SMEM, m TMA stores
                def product(acc):
                    for i in range(m):
                        plgpu.barrier_wait(wd_ready.at[(j + i) % dd])
                    plgpu.wgmma(acc, wd_smem.at[pl.ds((j % dd) * blk, m * blk)], y_smem.transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return acc[...]

                part = pl.run_scoped(product, plgpu.ACC((m * blk, R), F32))
                for i in range(m):
                    if j + i + dd < down_blocks:
                        issue_down(j + i + dd)
                first = (j % od) * blk
                # the stores that last used these output rows (od blocks ago) have read them
                plgpu.wait_smem_to_gmem(od - m, wait_read_only=True)
                out_smem.at[pl.ds(first, m * blk)][...] = part
                plgpu.commit_smem()
                if j == 0:  # the accumulator is zeroed (a release add after its stores completed); the poll
                    # waits here, after the first group's product, not ahead of it
                    plgpu.semaphore_wait(counter.at[0], 1, decrement=False, memory_scope="gpu")
                for i in range(m):
                    plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(first + i * blk, blk)],
                                            acc_gmem.at[pl.ds((j + i) * blk, blk)], reduction_op="add")

            for j in range(0, down_blocks, group):
                down_group(j, min(group, down_blocks - j))
            plgpu.wait_smem_to_gmem(0)

        with jax.named_scope("down"):
            pl.run_scoped(down, plgpu.SMEM((od * blk, R), F32, transforms=part_tf))

    def zero(acc_gmem, counter, scratch):
        (z_smem,), () = scratch
        z_smem[...] = jnp.zeros((TILE, R), F32)
        plgpu.commit_smem()
        for t in range(out_tiles):
            plgpu.copy_smem_to_gmem(z_smem, acc_gmem.at[pl.ds(t * TILE, TILE)])
        plgpu.wait_smem_to_gmem(0)
        plgpu.semaphore_signal(counter.at[0], 1, memory_scope="gpu")

    def mlp_body(h_gmem, wg_gmem, wu_gmem, wd_gmem, acc_gmem):
        p = lax.axis_index("p")
        counter = pl.get_global(plgpu.SemaphoreType.REGULAR((2,)))

        @pl.when(p == 0)
        def _():
            pl.run_scoped(lambda *s: zero(acc_gmem, counter, s),
                          (plgpu.SMEM((TILE, R), F32, transforms=part_tf),), ())

        @pl.when(p > 0)
        def _():
            pl.run_scoped(
                lambda *s: gate_up_down(p - 1, h_gmem, wg_gmem, wu_gmem, wd_gmem, acc_gmem, counter, s),
                (bf16((d_blocks, R, BLOCK_K)), bf16((dd * blk, TILE)), bf16((R, TILE))),
                (plgpu.Barrier(num_barriers=d_blocks), plgpu.Barrier(num_barriers=2 * gd),
                 plgpu.Barrier(num_barriers=dd)),
            )

        # leave the counters at zero for the next call: the last CTA resets them once every CTA is past its wait
        plgpu.semaphore_signal(counter.at[1], 1, memory_scope="gpu")

        @pl.when(p == ctas)
        def _():
            plgpu.semaphore_wait(counter.at[1], ctas + 1, memory_scope="gpu")
            plgpu.semaphore_signal(counter.at[0], -1, memory_scope="gpu")

    params = plgpu.CompilerParams(profile_space=16, profile_dir=profile_dir) if profile_dir else None
    return plgpu.kernel(mlp_body, out_type=jax.ShapeDtypeStruct((D, R), F32), grid=(plan.programs,),
                        grid_names=("p",),
                        compiler_params=params)(h, w_gate, w_up, w_down)


def gated_mlp_residual_unsupported(x, norm_weight, w_gate, w_up, w_down, act) -> str | None:
    """Why the kernel cannot take these arguments (None where it can, given a schedule)."""
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        return f"x must be [rows, hidden] bf16 (got {x.shape} {x.dtype})"
    rows, hidden = x.shape
    inter = w_gate.shape[0]
    if (w_gate.shape != (inter, hidden) or w_up.shape != (inter, hidden) or w_down.shape != (hidden, inter)
            or norm_weight.shape != (hidden,)):
        return "weights must be gate/up [I, hidden], down [hidden, I], norm [hidden]"
    if any(w.dtype != x.dtype for w in (norm_weight, w_gate, w_up, w_down)):
        return "weights must share x's dtype"
    if act not in ACTIVATIONS:
        return f"activation {act!r} not in {ACTIVATIONS}"
    return None


def gated_mlp_residual(x, norm_weight, eps, w_gate, w_up, w_down, act, *, sms: int | None = None):
    """``apriel2_jax.ops.decode_fused.gated_mlp_residual`` (x + MLP(rmsnorm(x)), x [rows, hidden]) with the norm
    and the MLP as one kernel; the rows' padding to 8 before it and the residual add after it are XLA fusions.
    ``sms``: the GPU's SM count (default: the first device's). Shapes the kernel does not take, and fewer than
    ``MIN_ROWS`` rows, run the dispatched ``norm_gated_mlp`` and ``matmul_add`` instead."""
    plan = None
    if gated_mlp_residual_unsupported(x, norm_weight, w_gate, w_up, w_down, act) is None and x.shape[0] >= MIN_ROWS:
        plan = schedule(x.shape[0], x.shape[1], w_gate.shape[0], sms or jax.devices()[0].core_count)
    if plan is None:
        product = dispatch.op("norm_gated_mlp")(x, norm_weight, eps, w_gate, w_up, act)
        return dispatch.op("matmul_add")(product, w_down, x)
    rows = x.shape[0]
    h = rms_norm(jnp.pad(x, ((0, plan.rows - rows), (0, 0))), norm_weight, eps)
    down = gated_mlp_sum(h, w_gate, w_up, w_down, act=act, plan=plan)
    return x + down[:, :rows].T.astype(x.dtype)
