"""The gated MLP of a decode step for up to 32 rows as one persistent Mosaic GPU kernel: gate/up projections with
the activation product, then the down projection, with one grid-wide dependence between them instead of a kernel
boundary. The jnp oracle is ``apriel2_jax.ops.decode_fused.gated_mlp_residual``.

Why. At a few rows the MLP reads its three matrices once (26 MB of the 0.5B geometry's 30 MB per layer) and does
little arithmetic, so its floor is bytes over bandwidth. As separate kernels each pays a start and a tail (~2 µs
on an H200) and streams below the bandwidth a single pipeline reaches (``scripts/bench_weight_streaming.py``). Here
every CTA issues its weight loads (TMA into a ring of SMEM stages) at the start, the down projection's included:
they do not depend on the gate/up result, so they stream while the gate/up CTAs compute.

Design (one CTA per SM, two roles):

- **gate/up CTAs** (one per 64 intermediate features): [64, 128] blocks of the gate and up weights are the wgmma A
  operand and the normalised rows the B operand (swap-AB: the rows, padded to 8, are the N dimension), so a few
  rows cost no padding to 64. The epilogue rounds gate and up to the dtype, applies the activation in fp32,
  rounds, multiplies (as the reference), transposes the [64, rows] tile through SMEM into rows-major ``y`` in
  HBM (L2) and counts itself done on a global counter.
- **down CTAs** (the rest; each a [64 output features, I / splits] block of the down projection): their first
  ``down_depth`` weight blocks (all of them at up to 8 rows on the 0.5B geometry) load while the gate/up CTAs
  work; once the counter reaches the gate/up CTAs' number they load their slice of ``y``, run the wgmmas and write
  a float32 partial [64, rows]. The caller sums the ``splits`` partials and adds the residual
  (one small fusion, which XLA merges with the next layer's norm where it can).

The schedule needs intermediate / 64 + hidden / 64 CTAs at least (0.5B: 76 + 14 x 4 splits = 132 = an H200's
SMs); ``schedule`` returns None where the GPU has too few, and ``gated_mlp_residual`` then runs the dispatched
``norm_gated_mlp`` and ``matmul_add``.

The gate/up CTAs have the lowest indices, so they are scheduled no later than the down CTAs that spin on their
counter (every CTA is resident at once: one per SM). The product goes to HBM by TMA stores that complete before the
release add, and comes back by TMA loads after the acquiring wait; Pallas exposes no ``fence.proxy.async`` for
global memory, and repeated calls on the GPU gave identical results.

Status: equal to the bf16 jnp chain on the GPU (1-32 rows, three geometries, silu and tanh-gelu;
``tests/pallas_kernels/test_decode_mlp.py`` checks it where a GPU is present), but not clearly faster than what
the engine runs, so it is not registered (``bench_generate.py --decode-mlp-kernel`` registers it).
Measured on an H200, 2026-11-25 (8 layers of 0.5B weights chained; µs per layer, the norm and the partials' sum
included): 19.8 against the GEMV kernels' 14.5 at one row, 20.1 against XLA's 17.8 at 8 rows, 20.2 against 21.9
at 32. Its bytes stream in ~7 µs at the rates measured for these CTA counts; the rest is serial latency (the
kernel's start and tail, the grid-wide wait, the down CTAs' loads of the product, wgmmas and stores after it, and
the XLA norm and sum around it). See docs/BENCHMARKS.md.
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
TILE = 64  # wgmma's M: weight rows per tile
BLOCK_K = 128  # input width of every weight load: [64, 128] bf16 blocks (16 KB), 256-byte rows. With 128-byte rows
# ([64, 64] blocks) 76 CTAs streamed 17.4 MB at 2.8 TB/s against 3.7 (H200, 2026-11-25)
MAX_ROWS = 32
MIN_ROWS = 8  # fewer rows take the dispatched norm_gated_mlp and matmul_add (decode_gemv's kernels on the GPU)
SMEM_BYTES = 220 * 1024  # of the 227 KB a Hopper CTA may use: headroom for barriers and Mosaic's scratch
_SWIZZLE = 128  # bytes of a 64-element bf16 row: the swizzle of the 64-column tiles of every bf16 SMEM block
ACTIVATIONS = ("silu", "sigmoid", "relu", "gelu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which CTA does what. CTAs [0, gate_up_ctas) each own 64 intermediate features; the next
    ``out_tiles * splits`` each own one (64 output features, K split) block of the down projection."""

    rows: int  # padded to 8
    hidden: int
    intermediate: int
    gate_up_ctas: int
    out_tiles: int
    splits: int
    gate_up_depth: int  # ring stages of (gate, up) block pairs
    down_depth: int  # ring stages of down blocks

    def k_range(self, split: int):
        """The [first, last) ``BLOCK_K`` blocks of the intermediate width that down split ``split`` reads
        (balanced to within one block; works on Python ints and traced ones)."""
        return split * self.k_blocks // self.splits, (split + 1) * self.k_blocks // self.splits

    @property
    def k_blocks(self) -> int:
        return self.intermediate // BLOCK_K

    @property
    def max_down_blocks(self) -> int:
        return -(-self.k_blocks // self.splits)

    @property
    def programs(self) -> int:
        return self.gate_up_ctas + self.out_tiles * self.splits


def schedule(rows: int, hidden: int, intermediate: int, sms: int) -> Schedule | None:
    """The kernel's schedule for ``rows`` rows of a [hidden -> intermediate -> hidden] MLP on ``sms`` SMs, or None
    where it does not fit (widths not multiples of 128, more than ``MAX_ROWS`` rows, too few SMs for one CTA per
    gate/up tile and per output tile, SMEM). Plain Python: ``gated_mlp_residual`` decides with it at trace time."""
    if not 1 <= rows <= MAX_ROWS or hidden % BLOCK_K or intermediate % BLOCK_K:
        return None
    rows8 = -(-rows // 8) * 8
    gate_up, out_tiles = intermediate // TILE, hidden // TILE
    if gate_up + out_tiles > sms:
        return None
    splits = min((sms - gate_up) // out_tiles, intermediate // BLOCK_K)
    block = TILE * BLOCK_K * 2
    # gate/up CTA: the normalised rows (all of the hidden width), the output tile, then as many stages as fit
    gate_up_depth = min(hidden // BLOCK_K, (SMEM_BYTES - rows8 * hidden * 2 - rows8 * TILE * 2) // (2 * block))
    # down CTA: its slice of y, the float32 partial, then stages
    max_blocks = -(-(intermediate // BLOCK_K) // splits)
    down_depth = min(max_blocks, (SMEM_BYTES - rows8 * BLOCK_K * 2 * max_blocks - TILE * rows8 * 4) // block)
    if gate_up_depth < 1 or down_depth < 1:
        return None
    return Schedule(rows8, hidden, intermediate, gate_up, out_tiles, splits, gate_up_depth, down_depth)


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


def gated_mlp_partials(h: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, act: str,
                       plan: Schedule) -> jax.Array:
    """h: [rows8, hidden] normalised rows (bf16); w_gate, w_up: [I, hidden]; w_down: [hidden, I]. Returns the down
    projection's split partials, float32 [splits, hidden, rows8] (transposed: the wgmma's rows are features)."""
    rows, hidden, inter = plan.rows, plan.hidden, plan.intermediate
    dtype = h.dtype
    d_blocks = hidden // BLOCK_K
    gate_up_ctas, splits, k_blocks = plan.gate_up_ctas, plan.splits, plan.k_blocks
    down_ctas = plan.out_tiles * splits
    gate_up_depth, down_depth, max_blocks = plan.gate_up_depth, plan.down_depth, plan.max_down_blocks
    partial_swizzle = plgpu.find_swizzle(rows * 32)
    partial_transforms = (plgpu.TilingTransform((8, partial_swizzle // 4)), plgpu.SwizzleTransform(partial_swizzle))

    def gate_up(p, h_gmem, wg_gmem, wu_gmem, y_gmem, counter, scratch):
        (h_smem, w_smem, y_smem), (h_ready, w_ready) = scratch
        row0 = p * TILE

        def issue(step):
            slot = step % gate_up_depth
            cols = pl.ds(step * BLOCK_K, BLOCK_K)
            plgpu.copy_gmem_to_smem(wg_gmem.at[pl.ds(row0, TILE), cols], w_smem.at[0, slot], w_ready.at[slot])
            plgpu.copy_gmem_to_smem(wu_gmem.at[pl.ds(row0, TILE), cols], w_smem.at[1, slot],
                                    w_ready.at[gate_up_depth + slot])

        for step in range(gate_up_depth):
            issue(step)
        for c in range(d_blocks):
            plgpu.copy_gmem_to_smem(h_gmem.at[:, pl.ds(c * BLOCK_K, BLOCK_K)], h_smem.at[c], h_ready.at[c])

        def accumulate(acc_g, acc_u):
            def step_fn(step, _):
                slot = step % gate_up_depth
                plgpu.barrier_wait(h_ready.at[step])
                plgpu.barrier_wait(w_ready.at[slot])
                plgpu.barrier_wait(w_ready.at[gate_up_depth + slot])
                rhs = h_smem.at[step].transpose((1, 0))
                plgpu.wgmma(acc_g, w_smem.at[0, slot], rhs)
                plgpu.wgmma(acc_u, w_smem.at[1, slot], rhs)
                plgpu.wgmma_wait(2)  # this step's pair may still run; the previous step's slot is free

                @pl.when((step > 0) & (step - 1 + gate_up_depth < d_blocks))
                def _():
                    issue(step - 1 + gate_up_depth)

            lax.fori_loop(0, d_blocks, step_fn, None)
            plgpu.wgmma_wait(0)
            return acc_g[...], acc_u[...]

        g, u = pl.run_scoped(accumulate, plgpu.ACC((TILE, rows), F32), plgpu.ACC((TILE, rows), F32))
        g = g.astype(dtype).astype(F32)
        u = u.astype(dtype).astype(F32)
        y = (_activation(act, g).astype(dtype).astype(F32) * u).astype(dtype)
        # [64 features, rows] -> rows-major [rows, 64]: the down CTAs' wgmma B operand, as their TMA loads it
        y_smem.transpose((1, 0))[...] = plgpu.layout_cast(y, plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(y_smem, y_gmem.at[:, pl.ds(row0, TILE)])
        plgpu.wait_smem_to_gmem(0)
        plgpu.semaphore_signal(counter.at[0], 1, memory_scope="gpu")

    def down(p, wd_gmem, y_gmem, part_gmem, counter, scratch):
        (w_smem, y_smem, o_smem), (w_ready, y_ready) = scratch
        unit = p - gate_up_ctas
        out_tile, split = unit // splits, unit % splits
        first, last = plan.k_range(split)
        blocks = last - first

        def issue(step):
            slot = step % down_depth
            plgpu.copy_gmem_to_smem(
                wd_gmem.at[pl.ds(out_tile * TILE, TILE), pl.ds((first + step) * BLOCK_K, BLOCK_K)],
                w_smem.at[slot], w_ready.at[slot])

        for step in range(down_depth):
            pl.when(step < blocks)(functools.partial(issue, step))
        # every gate/up CTA has stored its tile of y (release add after its store completed)
        plgpu.semaphore_wait(counter.at[0], gate_up_ctas, decrement=False, memory_scope="gpu")
        for j in range(max_blocks):
            pl.when(j < blocks)(lambda j=j: plgpu.copy_gmem_to_smem(
                y_gmem.at[:, pl.ds((first + j) * BLOCK_K, BLOCK_K)], y_smem.at[j], y_ready.at[j]))

        def accumulate(acc):
            def step_fn(step, _):
                slot = step % down_depth
                plgpu.barrier_wait(w_ready.at[slot])
                plgpu.barrier_wait(y_ready.at[step])
                plgpu.wgmma(acc, w_smem.at[slot], y_smem.at[step].transpose((1, 0)))
                plgpu.wgmma_wait(1)

                @pl.when((step > 0) & (step - 1 + down_depth < blocks))
                def _():
                    issue(step - 1 + down_depth)

            lax.fori_loop(0, blocks, step_fn, None)
            plgpu.wgmma_wait(0)
            return acc[...]

        o_smem[...] = pl.run_scoped(accumulate, plgpu.ACC((TILE, rows), F32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, part_gmem.at[split, pl.ds(out_tile * TILE, TILE)])
        plgpu.wait_smem_to_gmem(0)
        # leave the counter at zero for the next call: the first down CTA resets it once all are past their wait
        plgpu.semaphore_signal(counter.at[1], 1, memory_scope="gpu")

        @pl.when(unit == 0)
        def _():
            plgpu.semaphore_wait(counter.at[1], down_ctas, memory_scope="gpu")
            plgpu.semaphore_signal(counter.at[0], -gate_up_ctas, memory_scope="gpu")

    def body(h_gmem, wg_gmem, wu_gmem, wd_gmem, part_gmem, y_gmem):
        p = lax.axis_index("p")
        counter = pl.get_global(plgpu.SemaphoreType.REGULAR((2,)))

        @pl.when(p < gate_up_ctas)
        def _():
            pl.run_scoped(
                lambda *s: gate_up(p, h_gmem, wg_gmem, wu_gmem, y_gmem, counter, s),
                (plgpu.SMEM((d_blocks, rows, BLOCK_K), dtype, transforms=_bf16_tiles()),
                 plgpu.SMEM((2, gate_up_depth, TILE, BLOCK_K), dtype, transforms=_bf16_tiles()),
                 plgpu.SMEM((rows, TILE), dtype, transforms=_bf16_tiles())),
                (plgpu.Barrier(num_barriers=d_blocks), plgpu.Barrier(num_barriers=2 * gate_up_depth)),
            )

        @pl.when(p >= gate_up_ctas)
        def _():
            pl.run_scoped(
                lambda *s: down(p, wd_gmem, y_gmem, part_gmem, counter, s),
                (plgpu.SMEM((down_depth, TILE, BLOCK_K), dtype, transforms=_bf16_tiles()),
                 plgpu.SMEM((max_blocks, rows, BLOCK_K), dtype, transforms=_bf16_tiles()),
                 plgpu.SMEM((TILE, rows), F32, transforms=partial_transforms)),
                (plgpu.Barrier(num_barriers=down_depth), plgpu.Barrier(num_barriers=max_blocks)),
            )

    part, _ = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((splits, hidden, rows), F32), jax.ShapeDtypeStruct((rows, inter), dtype)),
        grid=(plan.programs,),
        grid_names=("p",),
    )(h, w_gate, w_up, w_down)
    return part


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
    """``apriel2_jax.ops.decode_fused.gated_mlp_residual`` (x + MLP(rmsnorm(x)), x [rows, hidden]) with the MLP
    as one kernel; the norm before it and the partials' sum with the residual after it are XLA fusions. ``sms``:
    the GPU's SM count (default: the first device's). Shapes the kernel does not take, and fewer than
    ``MIN_ROWS`` rows, run the dispatched ``norm_gated_mlp`` and ``matmul_add`` instead."""
    plan = None
    if gated_mlp_residual_unsupported(x, norm_weight, w_gate, w_up, w_down, act) is None and x.shape[0] >= MIN_ROWS:
        plan = schedule(x.shape[0], x.shape[1], w_gate.shape[0], sms or jax.devices()[0].core_count)
    if plan is None:
        product = dispatch.op("norm_gated_mlp")(x, norm_weight, eps, w_gate, w_up, act)
        return dispatch.op("matmul_add")(product, w_down, x)
    h = jnp.pad(rms_norm(x, norm_weight, eps), ((0, plan.rows - x.shape[0]), (0, 0)))
    part = gated_mlp_partials(h, w_gate, w_up, w_down, act, plan)
    return x + jnp.sum(part, axis=0)[:, : x.shape[0]].T.astype(x.dtype)
