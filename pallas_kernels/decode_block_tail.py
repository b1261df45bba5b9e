"""The second half of a decoder block at decode, for up to 32 rows, as one persistent Mosaic GPU kernel: the mixer's
output projection added to the residual stream, the post-mixer RMSNorm, the gated MLP's gate/up projections with
the activation product, and its down projection. The jnp oracle is
``apriel2_jax.ops.decode_fused.out_proj_mlp_residual``.

Why. At a few rows this half of a layer reads 27.7 MB of weights (0.5B geometry) and does little arithmetic. As
the engine's decode GEMV kernels it is three kernels in a chain (output projection, norm + gate/up, down), each
paying a start, a first-load latency and a tail (~2 µs each on an H200) and streaming at 1.5-2.1 TB/s. Here every
CTA issues its weight loads (TMA into SMEM stages) as it starts, whatever phase they belong to: the gate/up and
down weights stream while the output projection runs, and each dependence between phases is a grid-wide counter
instead of a kernel boundary.

Design (one CTA per SM, three roles; rows padded to 8 are the wgmma N dimension, so few rows cost no padding to 64):

- **output-projection CTAs** (one per 64 features of the hidden width): [64, 128] blocks of ``w_o`` are the wgmma A
  operand and the mixer's output rows the B operand. The epilogue rounds the projection to the dtype, adds the
  residual tile (rounded, as ``residual + Linear``), stores it rows-major to ``x1`` with its rows' sums of squares
  (the norm's statistics) and counts itself done.
- **gate/up CTAs** (one per 64 intermediate features): once every output tile is stored, they load all of ``x1``
  (from L2) and the output tiles' sums of squares, normalise ``x1`` in SMEM as ``ops.norms.rms_norm`` rounds (fp32
  statistics, cast, times the weight), run
  their gate/up blocks (already loaded) against it, round, apply the activation in fp32, round, multiply, store
  their tile of the product ``y`` rows-major and count themselves done.
- **down CTAs** (each a 64-feature tile and a K split of the down projection): their weight blocks load from the
  start; once every gate/up tile is stored they load their slice of ``y`` through a small ring and write a float32
  partial.

The caller adds the partials' sum to ``x1`` (one small fusion, rounded as the reference: the projection, then the
add). The schedule needs hidden / 64 + intermediate / 64 + hidden / 64 CTAs at least (0.5B: 14 + 76 + 14 x 3
splits = 132, an H100's or H200's SMs); ``schedule`` returns None otherwise and the entry runs the dispatched
chain. Producers have lower CTA indices than the CTAs that wait on them, and every CTA is resident at once (one per
SM), so the waits cannot deadlock. Stores complete before each release add and the loads that read them follow the
acquiring wait (the pattern of ``decode_mlp``, checked on the GPU there).

Status: equal to the bf16 jnp chain on the GPU (1-32 rows; ``tests/pallas_kernels/test_decode_block_tail.py`` checks
it where a GPU is present) and not registered: it is slower than the engine's kernels at one row and ~9% faster than
XLA at 32 (24 layers of 0.5B weights chained, H200, 2026-11-27, ``scripts/bench_block_tail.py``: 19.2-19.7 µs per
layer against 16.2-16.4 at one row, 23.3-23.4 against 25.6-25.9 at 32). Its per-CTA trace (``--profile``) shows
why: a phase that runs on few CTAs is bound by each SM's own load rate (the 14 output-projection CTAs take 4-6 µs
for 112 KB each while the other CTAs' weights stream), and each grid-wide dependence (store, release add, acquiring
wait, loads from L2) costs ~2.5-3.5 µs. A faster design spreads every phase's weights over all SMs and keeps the next
layer's weights in flight across the dependences. See docs/BENCHMARKS.md.
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
from pallas_kernels.decode_mlp import ACTIVATIONS, _activation, _bf16_tiles

F32 = jnp.float32
TILE = 64  # wgmma's M: weight rows per tile
BLOCK_K = 128  # input width of every weight load: [64, 128] bf16 blocks (16 KB), 256-byte rows
Y_DEPTH = 4  # ring stages of the down CTAs' [rows, 128] slices of y (from L2), leaving SMEM to weight stages
MAX_ROWS = 32
SMEM_BYTES = 220 * 1024  # of the 227 KB a Hopper CTA may use: headroom for barriers and Mosaic's scratch
_BLOCK_BYTES = TILE * BLOCK_K * 2


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which CTA does what: [0, out_tiles) output-projection tiles; the next ``gate_up_ctas`` gate/up tiles; the
    next ``out_tiles * splits`` (down tile, K split) units."""

    rows: int  # padded to 8
    inner: int  # the output projection's input width (the mixer's output)
    hidden: int
    intermediate: int
    splits: int
    o_depth: int  # ring stages of output-projection blocks
    gate_up_depth: int  # ring stages of (gate, up) block pairs
    down_depth: int  # ring stages of down blocks

    @property
    def out_tiles(self) -> int:
        return self.hidden // TILE

    @property
    def gate_up_ctas(self) -> int:
        return self.intermediate // TILE

    @property
    def k_blocks(self) -> int:
        return self.intermediate // BLOCK_K

    @property
    def max_down_blocks(self) -> int:
        return -(-self.k_blocks // self.splits)

    @property
    def programs(self) -> int:
        return self.out_tiles + self.gate_up_ctas + self.out_tiles * self.splits

    def k_range(self, split):
        """The [first, last) ``BLOCK_K`` blocks of the intermediate width that down split ``split`` reads
        (balanced to within one block; works on Python ints and traced ones)."""
        return split * self.k_blocks // self.splits, (split + 1) * self.k_blocks // self.splits


def schedule(rows: int, inner: int, hidden: int, intermediate: int, sms: int) -> Schedule | None:
    """The kernel's schedule for ``rows`` rows on ``sms`` SMs, or None where it does not fit (widths not multiples
    of 128, more than ``MAX_ROWS`` rows, too few SMs for a CTA per output tile, gate/up tile and down unit, SMEM).
    Plain Python: the entry decides with it at trace time."""
    if not 1 <= rows <= MAX_ROWS or any(w % BLOCK_K for w in (inner, hidden, intermediate)):
        return None
    rows8 = -(-rows // 8) * 8
    out_tiles, gate_up = hidden // TILE, intermediate // TILE
    splits = min((sms - out_tiles - gate_up) // out_tiles, intermediate // BLOCK_K) if sms > out_tiles + gate_up else 0
    if splits < 1:
        return None
    out_tile = rows8 * TILE * 2
    # output-projection CTA: the mixer's rows (all of the inner width), the residual tile, the x1 tile, stages
    o_depth = min(inner // BLOCK_K, (SMEM_BYTES - rows8 * inner * 2 - 2 * out_tile) // _BLOCK_BYTES)
    # gate/up CTA: x1 normalised in place (all of the hidden width), the product tile, the norm weight, stages
    gate_up_depth = min(hidden // BLOCK_K,
                        (SMEM_BYTES - rows8 * hidden * 2 - out_tile - hidden * 2 - out_tiles * rows8 * 4)
                        // (2 * _BLOCK_BYTES))
    # down CTA: a ring of y slices, the float32 partial, stages
    max_blocks = -(-(intermediate // BLOCK_K) // splits)
    down_depth = min(max_blocks, (SMEM_BYTES - rows8 * BLOCK_K * 2 * Y_DEPTH - TILE * rows8 * 4) // _BLOCK_BYTES)
    if min(o_depth, gate_up_depth, down_depth) < 1:
        return None
    return Schedule(rows8, inner, hidden, intermediate, splits, o_depth, gate_up_depth, down_depth)


def _stream(blocks: int, depth: int, issue, consume):
    """Consume ``blocks`` weight blocks through a ring of ``depth`` stages whose first loads are already issued:
    ``consume(step, slot)`` runs the step's wgmmas; the slot of the step before is refilled once they retire."""
    def step_fn(step, _):
        consume(step, step % depth)

        @pl.when((step > 0) & (step - 1 + depth < blocks))
        def _():
            issue(step - 1 + depth)

    lax.fori_loop(0, blocks, step_fn, None)
    plgpu.wgmma_wait(0)


def block_tail_partials(a, x, w_o, norm_weight, w_gate, w_up, w_down, *, eps: float, act: str, plan: Schedule,
                        profile_dir: str | None = None):
    """a: [rows8, inner] the mixer's output rows; x: [rows8, hidden] the residual stream (bf16); w_o [hidden,
    inner]; norm_weight [hidden]; w_gate, w_up [I, hidden]; w_down [hidden, I]. Returns ``x1 = x + a @ w_o.T``
    [rows8, hidden] and the down projection's split partials of ``mlp(rms_norm(x1))``, float32 [splits, hidden,
    rows8] (transposed: the wgmma's rows are features). ``profile_dir``: write Mosaic GPU's trace of each CTA's
    phases there (a JSON file per call; ``scripts/bench_block_tail.py --profile`` reads them)."""
    rows, inner, hidden, inter = plan.rows, plan.inner, plan.hidden, plan.intermediate
    dtype = x.dtype
    i_blocks, d_blocks = inner // BLOCK_K, hidden // BLOCK_K
    out_tiles, gate_up_ctas, splits = plan.out_tiles, plan.gate_up_ctas, plan.splits
    o_depth, gate_up_depth, down_depth, max_blocks = plan.o_depth, plan.gate_up_depth, plan.down_depth, \
        plan.max_down_blocks
    partial_swizzle = plgpu.find_swizzle(rows * 32)
    partial_transforms = (plgpu.TilingTransform((8, partial_swizzle // 4)), plgpu.SwizzleTransform(partial_swizzle))
    col = plgpu.Layout.WGMMA_TRANSPOSED  # [features, rows] arrays read from / written to rows-major SMEM
    per_feature = col.reduce(1)  # a [features] vector broadcast over rows
    per_row = col.reduce(0)  # a [rows] vector broadcast over features

    def out_proj(p, a_gmem, x_gmem, wo_gmem, x1_gmem, squares_gmem, counter, scratch):
        (a_smem, w_smem, res_smem, x1_smem, squares_smem), (a_ready, w_ready, res_ready) = scratch
        row0 = p * TILE

        def issue(step):
            plgpu.copy_gmem_to_smem(wo_gmem.at[pl.ds(row0, TILE), pl.ds(step * BLOCK_K, BLOCK_K)],
                                    w_smem.at[step % o_depth], w_ready.at[step % o_depth])

        for step in range(o_depth):
            issue(step)
        for c in range(i_blocks):
            plgpu.copy_gmem_to_smem(a_gmem.at[:, pl.ds(c * BLOCK_K, BLOCK_K)], a_smem.at[c], a_ready.at[c])
        plgpu.copy_gmem_to_smem(x_gmem.at[:, pl.ds(row0, TILE)], res_smem, res_ready.at[0])

        def accumulate(acc):
            def consume(step, slot):
                plgpu.barrier_wait(a_ready.at[step])
                plgpu.barrier_wait(w_ready.at[slot])
                plgpu.wgmma(acc, w_smem.at[slot], a_smem.at[step].transpose((1, 0)))
                plgpu.wgmma_wait(1)

            _stream(i_blocks, o_depth, issue, consume)
            return acc[...]

        with jax.named_scope("o_proj"):
            o = pl.run_scoped(accumulate, plgpu.ACC((TILE, rows), F32)).astype(dtype)
        plgpu.barrier_wait(res_ready.at[0])
        residual = plgpu.load(res_smem.transpose((1, 0)), layout=col)
        x1 = plgpu.layout_cast(o, col) + residual
        x1_smem.transpose((1, 0))[...] = x1
        x1 = x1.astype(F32)
        squares_smem[...] = jnp.sum(x1 * x1, axis=0)  # this tile's share of the norm's statistics
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x1_smem, x1_gmem.at[:, pl.ds(row0, TILE)])
        plgpu.copy_smem_to_gmem(squares_smem, squares_gmem.at[p])
        plgpu.wait_smem_to_gmem(0)
        plgpu.semaphore_signal(counter.at[0], 1, memory_scope="gpu")

    def gate_up(p, x1_gmem, squares_gmem, norm_gmem, wg_gmem, wu_gmem, y_gmem, counter, scratch):
        (h_smem, w_smem, y_smem, norm_smem, squares_smem), (h_ready, w_ready, norm_ready) = scratch
        row0 = (p - out_tiles) * TILE

        def issue(step):
            slot = step % gate_up_depth
            cols = pl.ds(step * BLOCK_K, BLOCK_K)
            plgpu.copy_gmem_to_smem(wg_gmem.at[pl.ds(row0, TILE), cols], w_smem.at[0, slot], w_ready.at[slot])
            plgpu.copy_gmem_to_smem(wu_gmem.at[pl.ds(row0, TILE), cols], w_smem.at[1, slot],
                                    w_ready.at[gate_up_depth + slot])

        for step in range(gate_up_depth):
            issue(step)
        plgpu.copy_gmem_to_smem(norm_gmem, norm_smem, norm_ready.at[0])
        # every output tile of x1 is stored (release add after its store completed)
        with jax.named_scope("wait_x1"):
            plgpu.semaphore_wait(counter.at[0], out_tiles, decrement=False, memory_scope="gpu")
        plgpu.copy_gmem_to_smem(squares_gmem, squares_smem, norm_ready.at[1])
        for c in range(d_blocks):
            plgpu.copy_gmem_to_smem(x1_gmem.at[:, pl.ds(c * BLOCK_K, BLOCK_K)], h_smem.at[c], h_ready.at[c])

        # RMSNorm in place, 64 features at a time as [64, rows] arrays (the transposed view of rows-major SMEM)
        def chunk(c):
            return h_smem.at[c // 2, :, pl.ds((c % 2) * TILE, TILE)].transpose((1, 0))

        with jax.named_scope("norm"):
            plgpu.barrier_wait(norm_ready.at[1])
            squares = sum(plgpu.load(squares_smem.at[t], layout=per_row) for t in range(out_tiles))
            scale = lax.rsqrt(squares / hidden + eps)
            plgpu.barrier_wait(norm_ready.at[0])
            for c in range(hidden // TILE):
                if c % 2 == 0:
                    plgpu.barrier_wait(h_ready.at[c // 2])
                xc = plgpu.load(chunk(c), layout=col).astype(F32)
                weight = plgpu.load(norm_smem.at[c // 2, pl.ds((c % 2) * TILE, TILE)], layout=per_feature)
                chunk(c)[...] = weight[:, None] * (xc * scale[None, :]).astype(dtype)
        plgpu.commit_smem()

        def accumulate(acc_g, acc_u):
            def consume(step, slot):
                plgpu.barrier_wait(w_ready.at[slot])
                plgpu.barrier_wait(w_ready.at[gate_up_depth + slot])
                rhs = h_smem.at[step].transpose((1, 0))
                plgpu.wgmma(acc_g, w_smem.at[0, slot], rhs)
                plgpu.wgmma(acc_u, w_smem.at[1, slot], rhs)
                plgpu.wgmma_wait(2)  # this step's pair may still run; the previous step's slot is free

            _stream(d_blocks, gate_up_depth, issue, consume)
            return acc_g[...], acc_u[...]

        with jax.named_scope("gate_up"):
            g, u = pl.run_scoped(accumulate, plgpu.ACC((TILE, rows), F32), plgpu.ACC((TILE, rows), F32))
        g = g.astype(dtype).astype(F32)
        u = u.astype(dtype).astype(F32)
        y = (_activation(act, g).astype(dtype).astype(F32) * u).astype(dtype)
        y_smem.transpose((1, 0))[...] = plgpu.layout_cast(y, col)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(y_smem, y_gmem.at[:, pl.ds(row0, TILE)])
        plgpu.wait_smem_to_gmem(0)
        plgpu.semaphore_signal(counter.at[1], 1, memory_scope="gpu")

    def down(p, wd_gmem, y_gmem, part_gmem, counter, scratch):
        (w_smem, y_smem, o_smem), (w_ready, y_ready) = scratch
        unit = p - out_tiles - gate_up_ctas
        out_tile, split = unit // splits, unit % splits
        first, last = plan.k_range(split)
        blocks = last - first

        def issue(step):
            plgpu.copy_gmem_to_smem(
                wd_gmem.at[pl.ds(out_tile * TILE, TILE), pl.ds((first + step) * BLOCK_K, BLOCK_K)],
                w_smem.at[step % down_depth], w_ready.at[step % down_depth])

        for step in range(down_depth):
            pl.when(step < blocks)(functools.partial(issue, step))

        def issue_y(step):
            plgpu.copy_gmem_to_smem(y_gmem.at[:, pl.ds((first + step) * BLOCK_K, BLOCK_K)],
                                    y_smem.at[step % Y_DEPTH], y_ready.at[step % Y_DEPTH])

        with jax.named_scope("wait_y"):
            plgpu.semaphore_wait(counter.at[1], gate_up_ctas, decrement=False, memory_scope="gpu")
        for step in range(Y_DEPTH):
            pl.when(step < blocks)(functools.partial(issue_y, step))

        def accumulate(acc):
            def consume(step, slot):
                plgpu.barrier_wait(w_ready.at[slot])
                plgpu.barrier_wait(y_ready.at[step % Y_DEPTH])
                plgpu.wgmma(acc, w_smem.at[slot], y_smem.at[step % Y_DEPTH].transpose((1, 0)))
                plgpu.wgmma_wait(1)  # the step before has retired: its y slot is free

                @pl.when((step > 0) & (step - 1 + Y_DEPTH < blocks))
                def _():
                    issue_y(step - 1 + Y_DEPTH)

            _stream(blocks, down_depth, issue, consume)
            return acc[...]

        with jax.named_scope("down"):
            o_smem[...] = pl.run_scoped(accumulate, plgpu.ACC((TILE, rows), F32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, part_gmem.at[split, pl.ds(out_tile * TILE, TILE)])
        plgpu.wait_smem_to_gmem(0)

    def body(a_gmem, x_gmem, wo_gmem, norm_gmem, wg_gmem, wu_gmem, wd_gmem, part_gmem, x1_gmem, y_gmem,
             squares_gmem):
        p = lax.axis_index("p")
        counter = pl.get_global(plgpu.SemaphoreType.REGULAR((3,)))
        bf16 = functools.partial(plgpu.SMEM, dtype=dtype, transforms=_bf16_tiles())

        @pl.when(p < out_tiles)
        def _():
            pl.run_scoped(
                lambda *s: out_proj(p, a_gmem, x_gmem, wo_gmem, x1_gmem, squares_gmem, counter, s),
                (bf16((i_blocks, rows, BLOCK_K)), bf16((o_depth, TILE, BLOCK_K)), bf16((rows, TILE)),
                 bf16((rows, TILE)), plgpu.SMEM((rows,), F32)),
                (plgpu.Barrier(num_barriers=i_blocks), plgpu.Barrier(num_barriers=o_depth),
                 plgpu.Barrier(num_barriers=1)),
            )

        @pl.when((p >= out_tiles) & (p < out_tiles + gate_up_ctas))
        def _():
            pl.run_scoped(
                lambda *s: gate_up(p, x1_gmem, squares_gmem, norm_gmem, wg_gmem, wu_gmem, y_gmem, counter, s),
                (bf16((d_blocks, rows, BLOCK_K)), bf16((2, gate_up_depth, TILE, BLOCK_K)), bf16((rows, TILE)),
                 plgpu.SMEM((d_blocks, BLOCK_K), dtype), plgpu.SMEM((out_tiles, rows), F32)),
                (plgpu.Barrier(num_barriers=d_blocks), plgpu.Barrier(num_barriers=2 * gate_up_depth),
                 plgpu.Barrier(num_barriers=2)),
            )

        @pl.when(p >= out_tiles + gate_up_ctas)
        def _():
            pl.run_scoped(
                lambda *s: down(p, wd_gmem, y_gmem, part_gmem, counter, s),
                (bf16((down_depth, TILE, BLOCK_K)), bf16((Y_DEPTH, rows, BLOCK_K)),
                 plgpu.SMEM((TILE, rows), F32, transforms=partial_transforms)),
                (plgpu.Barrier(num_barriers=down_depth), plgpu.Barrier(num_barriers=Y_DEPTH)),
            )

        # leave the counters at zero for the next call: the last CTA resets them once every CTA is past its wait
        plgpu.semaphore_signal(counter.at[2], 1, memory_scope="gpu")

        @pl.when(p == plan.programs - 1)
        def _():
            plgpu.semaphore_wait(counter.at[2], plan.programs, memory_scope="gpu")
            plgpu.semaphore_signal(counter.at[0], -out_tiles, memory_scope="gpu")
            plgpu.semaphore_signal(counter.at[1], -gate_up_ctas, memory_scope="gpu")

    part, x1, _, _ = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((splits, hidden, rows), F32), jax.ShapeDtypeStruct((rows, hidden), dtype),
                  jax.ShapeDtypeStruct((rows, inter), dtype), jax.ShapeDtypeStruct((out_tiles, rows), F32)),
        grid=(plan.programs,),
        grid_names=("p",),
        compiler_params=plgpu.CompilerParams(profile_space=16, profile_dir=profile_dir) if profile_dir else None,
    )(a, x, w_o, norm_weight.reshape(d_blocks, BLOCK_K), w_gate, w_up, w_down)  # TMA boxes: <= 256 a side
    return x1, part


def out_proj_mlp_residual_unsupported(a, x, w_o, norm_weight, w_gate, w_up, w_down, act) -> str | None:
    """Why the kernel cannot take these arguments (None where it can, given a schedule)."""
    if a.ndim != 2 or x.ndim != 2 or a.shape[0] != x.shape[0]:
        return f"a and x must be [rows, width] with the same rows (got {a.shape}, {x.shape})"
    if x.dtype != jnp.bfloat16:
        return f"x must be bf16 (got {x.dtype})"
    (rows, hidden), inner, inter = x.shape, a.shape[1], w_gate.shape[0]
    if (w_o.shape != (hidden, inner) or w_gate.shape != (inter, hidden) or w_up.shape != (inter, hidden)
            or w_down.shape != (hidden, inter) or norm_weight.shape != (hidden,)):
        return "weights must be w_o [hidden, inner], gate/up [I, hidden], down [hidden, I], norm [hidden]"
    if any(w.dtype != x.dtype for w in (a, w_o, norm_weight, w_gate, w_up, w_down)):
        return "a and the weights must share x's dtype"
    if act not in ACTIVATIONS:
        return f"activation {act!r} not in {ACTIVATIONS}"
    return None


def out_proj_mlp_residual(a, x, w_o, norm_weight, eps, w_gate, w_up, w_down, act, *, sms: int | None = None):
    """``apriel2_jax.ops.decode_fused.out_proj_mlp_residual`` (``x1 = x + a @ w_o.T``, then ``x1 +
    MLP(rmsnorm(x1))``) as one kernel and the partials' sum. Shapes the kernel does not take run the dispatched
    ``matmul_add`` and ``gated_mlp_residual``."""
    plan = None
    if out_proj_mlp_residual_unsupported(a, x, w_o, norm_weight, w_gate, w_up, w_down, act) is None:
        plan = schedule(x.shape[0], a.shape[1], x.shape[1], w_gate.shape[0], sms or jax.devices()[0].core_count)
    if plan is None:
        x1 = dispatch.op("matmul_add")(a, w_o, x)
        return dispatch.op("gated_mlp_residual")(x1, norm_weight, eps, w_gate, w_up, w_down, act)
    rows = x.shape[0]
    pad = ((0, plan.rows - rows), (0, 0))
    x1, part = block_tail_partials(jnp.pad(a, pad), jnp.pad(x, pad), w_o, norm_weight, w_gate, w_up, w_down,
                                   eps=eps, act=act, plan=plan)
    return x1[:rows] + jnp.sum(part, axis=0)[:, :rows].T.astype(x.dtype)
