"""Paged attention for the multi-token (chunked prefill) case in Pallas (Triton backend): flash attention whose
K/V blocks are read from the page pool through each row's block table.

Same contract as the reference ``apriel2_jax.ops.paged_attention.paged_attention``: q [S, T, H, D] holds T new
tokens per row (a valid prefix, then padding) at positions ``q_positions``; their K/V are already in the pages.
``block_table[s, j]`` is the page holding logical page ``first_page[s] + j``, so the key at table column j,
offset o has position ``(first_page[s] + j) * page_size + o``; entry 0 is the sink (an empty slot).

One program per (q head, query block of ``block_q`` tokens, row). It walks the row's keys in blocks of
``block_k`` *logical* key indices (not pages), from the first key the block's earliest query can see (window
start) to the last key its latest query can see (causal end), so neither the pages before the window nor the
pages after the chunk are read. Each key block is gathered row by row: key index -> (table column, offset) ->
page id -> row of the flat [P * page_size, G, D] pool, so any page size works; when ``block_k`` divides the page
size a block lies inside one page and is a single contiguous slice. The key loop is split in three: blocks at
the window's trailing edge and on the causal diagonal take the position mask, the blocks between (every query
of the block sees all their keys) take none. Empty pages (table entry 0) get a -inf bias, folded into the row
max when the block is one page. Scores are fp32 (``precision=HIGHEST`` for fp32 operands, so fp32 parity is
exact up to summation order; bf16 scores are not rounded to bf16 as the reference's are, so the kernel is the
closer of the two to fp32 math); the softmax is the online one, in base 2 with the scale folded into one
multiply; P is cast to V's dtype for the second matmul, which accumulates in fp32.

Loop bounds come from the min/max of the block's query positions, so they are right for any positions (the
engine's are consecutive per row; its padding tokens carry positions past the row's valid length, and padding
rows have all-empty tables). A query that sees no key at all (only possible for padding) outputs zeros, never
NaN: the running max starts at a finite value and the final normaliser is guarded.

Grid order: heads are the fastest launch dimension, so the H/G query heads that share a KV head run at the same
time and their K/V reads hit L2; query blocks run last-first, so the longest (causal) programs start first.

``paged_attention`` (the dispatch entry) uses this kernel; ``paged_attention_prefill_mgpu`` at the end of the file
is an experimental Mosaic GPU (Hopper, FA3-style) version: correct on an H100 and faster (0.84-0.94x cuDNN against
the Triton kernel's 0.57-0.70x, docs/BENCHMARKS.md), not dispatched.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from apriel2_jax.ops.paged_attention import check_paged_inputs

F32 = jnp.float32
LOG2E = math.log2(math.e)
_NO_MAX = -1e30  # running-max start: finite, so a fully masked block gives exp2(-inf - _NO_MAX) = 0, not NaN


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def supported(q: jax.Array, k_pages: jax.Array) -> bool:
    """Shapes the Triton backend can take: loads must have power-of-two element counts (head dim) and dots need
    K >= 16; the operand dtypes must be ones tensor cores take."""
    head_dim = q.shape[-1]
    return (
        _is_power_of_two(head_dim)
        and head_dim >= 16
        and q.dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
        and k_pages.dtype == q.dtype
    )


def _check_inputs(q, k_pages, v_pages, block_table, first_page, q_positions):
    check_paged_inputs(q, k_pages, v_pages, block_table, first_page, q_positions)
    head_dim = q.shape[-1]
    if not supported(q, k_pages):
        raise ValueError(
            f"unsupported shapes/dtypes for the Triton kernel: head dim {head_dim} (power of two >= 16), "
            f"q {q.dtype}, pages {k_pages.dtype} (same float dtype)"
        )


def _kernel(
    table_ref, first_ref, pos_ref, q_ref, k_ref, v_ref, o_ref,
    *, block_q, block_k, page_size, width, rep, scale, window, num_q_blocks, precision,
):
    head, row = pl.program_id(0), pl.program_id(2)
    qblock = num_q_blocks - 1 - pl.program_id(1)  # heaviest (latest) query blocks first
    group = head // rep
    tokens = pl.ds(qblock * block_q, block_q)
    q = q_ref[row, tokens, head, :]  # [bq, D]
    # Positions relative to the row's logical key 0, so a key's logical index is directly comparable.
    rel = pos_ref[row, tokens] - first_ref[row] * page_size  # [bq]

    first_q, last_q = jnp.min(rel), jnp.max(rel)
    last = jnp.maximum(jnp.minimum(last_q, width * page_size - 1), -1)  # last key any query of the block sees
    stop = (last + block_k) // block_k  # numerator >= 0: no negative floor division
    if window is None:
        start = jnp.int32(0)
    else:
        start = jnp.minimum(jnp.maximum(first_q - window + 1, 0) // block_k, stop)
    # Blocks every query of the block sees whole (all keys <= first_q, and > last_q - window) need no causal or
    # window mask: only the empty-page bias. They form [lo, hi) inside [start, stop); the rest (the diagonal,
    # the window's trailing edge) take the full mask.
    hi = jnp.maximum(first_q + 1, 0) // block_k
    lo = start if window is None else (jnp.maximum(last_q - window + 1, 0) + block_k - 1) // block_k
    lo = jnp.clip(lo, start, stop)
    hi = jnp.clip(hi, lo, stop)

    qk_scale = scale * LOG2E
    lane = jnp.arange(block_k, dtype=jnp.int32)

    def body(i, carry, masked):
        acc, m, l = carry
        keys = i * block_k + lane  # logical key indices of this block
        if page_size % block_k == 0:
            # The block lies in one page: one table entry, one contiguous slice of the pool.
            page = table_ref[row, (i * block_k) // page_size]
            rows_ = pl.ds(page * page_size + (i * block_k) % page_size, block_k)
            k = k_ref[rows_, group, :]
            v = v_ref[rows_, group, :]
        else:
            col = keys // page_size
            page = table_ref[row, jnp.minimum(col, width - 1)]  # [bk] gathered table entries
            page = jnp.where(col < width, page, 0)
            slots = page * page_size + keys % page_size
            k = k_ref[slots, group, :]
            v = v_ref[slots, group, :]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=F32)
        # Empty pages (table entry 0) get a -inf bias. (Typed constants: the Triton lowering mis-types
        # weak-typed scalar literals in a select.)
        bias = jnp.where(page != 0, F32(0.0), F32(-jnp.inf))
        if masked:
            visible = keys[None, :] <= rel[:, None]
            if window is not None:
                visible = visible & (keys[None, :] > rel[:, None] - window)
            s = jnp.where(visible, s, -jnp.inf)
        if bias.ndim:  # one bias per key: add it to the scores
            s = s * qk_scale + bias[None, :]
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.exp2(s - m_new[:, None])
        else:
            # One page for the whole block: fold the scalar bias into the row max instead of touching every score.
            # Empty page: m_new stays m and the subtrahend is +inf, so p = 0 without NaN (scores are never +inf).
            m_new = jnp.maximum(m, jnp.max(s, axis=1) * qk_scale + bias)
            p = jnp.exp2(s * qk_scale - (m_new - bias)[:, None])
        alpha = jnp.exp2(m - m_new)
        l = l * alpha + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=F32
        )
        return acc * alpha[:, None] + pv, m_new, l

    head_dim = q.shape[-1]
    carry = (
        jnp.zeros((block_q, head_dim), F32),
        jnp.full((block_q,), _NO_MAX, F32),
        jnp.zeros((block_q,), F32),
    )
    masked_body = functools.partial(body, masked=True)
    if window is not None:
        carry = jax.lax.fori_loop(start, lo, masked_body, carry)  # the window's trailing edge
    carry = jax.lax.fori_loop(lo, hi, functools.partial(body, masked=False), carry)
    acc, _, l = jax.lax.fori_loop(hi, stop, masked_body, carry)  # the causal diagonal (and padding's tail)
    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]  # l == 0: the query saw no key (padding only)
    o_ref[row, tokens, head, :] = out.astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("window", "block_q", "block_k", "num_warps", "num_stages", "interpret")
)
def paged_attention_prefill(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    first_page: jax.Array,
    q_positions: jax.Array,
    window: int | None = None,
    block_q: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """The kernel. Arguments as in the reference op; returns [S, T, H, D] in q's dtype.

    block_q / block_k: query tokens per program and keys per loop step (powers of two >= 16; block_q is capped
    at the next power of two of T, and T is padded up to a multiple of it). num_warps / num_stages: Triton's
    launch width and software-pipelining depth of the key loop."""
    _check_inputs(q, k_pages, v_pages, block_table, first_page, q_positions)
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if not _is_power_of_two(b) or b < 16:
            raise ValueError(f"{name}={b} must be a power of two >= 16 (Triton loads and dots)")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    rows, length, heads, head_dim = q.shape
    num_pages, page_size, groups, _ = k_pages.shape
    width = block_table.shape[1]

    block_q = min(block_q, max(16, _next_power_of_two(length)))
    padded = -(-length // block_q) * block_q
    positions = q_positions.astype(jnp.int32)
    if padded != length:
        # Padding tokens repeat the last position: they widen no query block's key range.
        q = jnp.pad(q, ((0, 0), (0, padded - length), (0, 0), (0, 0)))
        positions = jnp.pad(positions, ((0, 0), (0, padded - length)), mode="edge")
    num_q_blocks = padded // block_q
    precision = jax.lax.Precision.HIGHEST if q.dtype == F32 else jax.lax.Precision.DEFAULT

    kernel = functools.partial(
        _kernel, block_q=block_q, block_k=block_k, page_size=page_size, width=width, rep=heads // groups,
        scale=head_dim**-0.5, window=window, num_q_blocks=num_q_blocks, precision=precision,
    )
    flat = (num_pages * page_size, groups, head_dim)  # a free reshape: pool rows addressed by page * size + offset
    out = pl.pallas_call(
        kernel,
        grid=(heads, num_q_blocks, rows),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(
        block_table.astype(jnp.int32),
        first_page.astype(jnp.int32),
        positions,
        q,
        k_pages.reshape(flat),
        v_pages.reshape(flat),
    )
    return out[:, :length] if padded != length else out


def launch_config(tokens: int, head_dim: int) -> dict:
    """The dispatch entry's launch configuration for chunks of ``tokens`` queries per row. D = 128 on long chunks:
    the Triton flash-attention tutorial's Hopper choice. D <= 64 on long chunks: the best of
    `scripts/bench_attention_prefill.py --engine-05b --sweep` (the 0.5B geometry's prefill step: 8 rows x 1024
    fresh tokens, 14/2 heads, pages of 16; H200): 0.107 ms against 0.141 for the D = 128 choice, cuDNN 0.094
    (docs/BENCHMARKS.md)."""
    if tokens >= 128 and head_dim <= 64:
        return dict(block_q=64, block_k=128, num_warps=4, num_stages=3)
    if tokens >= 128:
        return dict(block_q=128, block_k=64, num_warps=8, num_stages=3)
    return dict(block_q=64, block_k=64, num_warps=4, num_stages=3)


def paged_attention(q, k_pages, v_pages, block_table, first_page, q_positions, window=None):
    """The dispatch entry: the kernel for multi-token queries whose shapes it supports, the jnp op otherwise
    (single-token decode belongs to the decode kernel / reference)."""
    from apriel2_jax.ops.paged_attention import paged_attention as reference

    if q.ndim != 4 or q.shape[1] <= 1 or not supported(q, k_pages):
        return reference(q, k_pages, v_pages, block_table, first_page, q_positions, window)
    config = launch_config(q.shape[1], q.shape[-1])
    return paged_attention_prefill(q, k_pages, v_pages, block_table, first_page, q_positions, window, **config)


# ----------------------------------------------------------------------------------------------------------------
# Mosaic GPU (Hopper) variant: FA3-style warp specialisation over the page pool. Experimental: it cross-lowers and
# its interpretable formulation matches the reference in GPU interpret mode, but it has not run on a GPU yet, so
# the dispatch entry above keeps using the Triton kernel.
#
# One CTA per (q head, tile of 2 * block_q query tokens, row): two compute warpgroups own block_q rows each, a
# third warpgroup issues the TMA copies. Each KV step is block_kv keys inside one page (block_kv divides the page
# size): one TMA for K and one for V from ``pages.at[page, offsets, kv_head]``, into a ring of ``stages`` SMEM
# slots guarded by loaded/consumed barriers. Per-warpgroup step ranges (window start, unmasked interior, causal
# end) are computed in XLA from the query positions and read as scalars; the CTA loads the union of its two
# warpgroups' ranges and a warpgroup outside its own range only waits and releases the slot (so every barrier
# completion is awaited in order by every compute warpgroup). The row's block table is copied to SMEM once, so
# the per-step page lookups (TMA address, empty-page bias) are SMEM reads.
# ----------------------------------------------------------------------------------------------------------------

from jax import lax  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402


def mgpu_supported(q: jax.Array, k_pages: jax.Array, block_k: int = 64) -> bool:
    """bf16/f16 operands, head dim a multiple of 64 (128-byte swizzled rows), block_k dividing the page size."""
    return (
        q.dtype in (jnp.bfloat16, jnp.float16)
        and k_pages.dtype == q.dtype
        and q.shape[-1] % 64 == 0
        and q.shape[-1] <= 256
        and k_pages.shape[1] % block_k == 0
    )


def _mgpu_bounds(rel, width_keys, block_q, block_k, window):
    """Per (row, tile, warpgroup): key-step ranges [start, lo) masked, [lo, hi) unmasked, [hi, stop) masked, from
    the min/max relative query position of each warpgroup's block_q rows (same rules as the Triton kernel), plus
    the CTA's union [cta_start, cta_stop). Returns int32 [S, tiles, 10]."""
    rows, padded = rel.shape
    r = rel.reshape(rows, padded // (2 * block_q), 2, block_q)
    first_q, last_q = r.min(-1), r.max(-1)
    last = jnp.maximum(jnp.minimum(last_q, width_keys - 1), -1)
    stop = (last + block_k) // block_k
    if window is None:
        start = jnp.zeros_like(stop)
        lo = start
    else:
        start = jnp.minimum(jnp.maximum(first_q - window + 1, 0) // block_k, stop)
        lo = (jnp.maximum(last_q - window + 1, 0) + block_k - 1) // block_k
    hi = jnp.maximum(first_q + 1, 0) // block_k
    lo = jnp.clip(lo, start, stop)
    hi = jnp.clip(hi, lo, stop)
    per_wg = jnp.stack([start, lo, hi, stop], -1)  # [S, tiles, 2, 4]
    cta = jnp.stack([start.min(-1), stop.max(-1)], -1)  # [S, tiles, 2]
    return jnp.concatenate([cta, per_wg.reshape(rows, -1, 8)], -1).astype(jnp.int32)


def _mgpu_body(table_ref, bounds_ref, rel_ref, q_ref, k_ref, v_ref, out_ref, scratch, *, block_q, block_k, page_size,
               rep, scale, window, stages, interpretable, ping_pong, dtype):
    smem, (k_bar, v_bar, q_bar, table_bar), (k_free, v_free), schedule = scratch
    qo_smem2, k_smem, v_smem, p_smem2, table_smem = smem
    head, tile, row = lax.axis_index("heads"), lax.axis_index("q_seq"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    cta_start, cta_stop = bounds_ref[row, tile, 0], bounds_ref[row, tile, 1]
    head_dim = q_ref.shape[-1]
    layout = plgpu.Layout.WGMMA

    def page_of(step):
        return table_smem[(step * block_k) // page_size]

    # Ping-pong (FA3): the two compute warpgroups meet at a barrier twice per step, offset by half a step, so
    # one runs its softmax while the other has the tensor cores. Every step, skipped ones included, passes it
    # twice in each warpgroup, so the counts always match.
    def sync():
        if ping_pong:
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

    def arrive():
        if ping_pong:
            plgpu.barrier_arrive(schedule)

    def wait():
        if ping_pong:
            plgpu.barrier_wait(schedule)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo_smem = qo_smem2.at[wg]
        q_base = tile * (2 * block_q) + wg * block_q
        plgpu.copy_gmem_to_smem(q_ref.at[row, pl.ds(q_base, block_q), head], qo_smem, q_bar.at[wg])
        plgpu.barrier_wait(table_bar)
        plgpu.barrier_wait(q_bar.at[wg])
        base = 2 + wg * 4
        start, lo = bounds_ref[row, tile, base], bounds_ref[row, tile, base + 1]
        hi, stop = bounds_ref[row, tile, base + 2], bounds_ref[row, tile, base + 3]
        rel = plgpu.load(rel_ref.at[row, pl.ds(q_base, block_q)], layout=layout.reduce(1), optimized=False)
        qk_scale = scale * LOG2E

        # Each step's K is awaited at the end of the step before (inside P @ V for a computing step, as FA3
        # does, so the wait overlaps the tensor-core work), the first one before the loops.
        def wait_next_k(i):
            @pl.when(i + 1 < cta_stop)
            def _():
                plgpu.barrier_wait(k_bar.at[lax.rem(i + 1 - cta_start, stages)])

        def skip(i, carry):
            slot = lax.rem(i - cta_start, stages)
            plgpu.barrier_arrive(k_free.at[slot])
            sync()
            arrive()
            plgpu.barrier_wait(v_bar.at[slot])
            wait()
            plgpu.barrier_arrive(v_free.at[slot])
            wait_next_k(i)
            return carry

        def step(i, carry, masked):
            acc, m, l = carry
            slot = lax.rem(i - cta_start, stages)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                sync()
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((block_q, block_k), F32))
            plgpu.barrier_arrive(k_free.at[slot])
            # Empty page: a -inf bias folded into the row max (as in the Triton kernel), never into each score.
            bias = jnp.where(page_of(i) != 0, F32(0.0), F32(-jnp.inf))
            if masked:
                keys = plgpu.broadcasted_iota(jnp.int32, (block_q, block_k), 1, layout=layout) + i * block_k
                qpos = lax.broadcast_in_dim(rel, (block_q, block_k), [0])
                visible = keys <= qpos
                if window is not None:
                    visible = visible & (keys > qpos - window)
                s = jnp.where(visible, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1) * qk_scale + bias)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_new - bias, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(dtype)
            # FA3 keeps the softmax results ahead of the schedule barrier (its measured best order for D <= 128).
            acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
            arrive()
            plgpu.barrier_wait(v_bar.at[slot])
            wait()
            if interpretable:  # P through SMEM and a fresh accumulator: what GPU interpret mode can run
                p_smem = p_smem2.at[wg]
                p_smem[...] = p16
                plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                    wait_next_k(i)
                    return acc_ref[...]

                acc = acc + pl.run_scoped(pv, plgpu.ACC((block_q, head_dim), F32))
            else:  # P from registers, accumulating into the running output (FA3)
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    wait_next_k(i)

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        carry = (
            plgpu.layout_cast(jnp.zeros((block_q, head_dim), F32), layout),
            plgpu.layout_cast(jnp.full((block_q,), _NO_MAX, F32), layout.reduce(1)),
            plgpu.layout_cast(jnp.zeros((block_q,), F32), layout.reduce(1)),
        )
        pl.when(wg == 1)(sync)

        @pl.when(cta_start < cta_stop)
        def _():
            plgpu.barrier_wait(k_bar.at[0])

        lax.fori_loop(cta_start, start, skip, None)
        masked = functools.partial(step, masked=True)
        carry = lax.fori_loop(start, lo, masked, carry)
        carry = lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
        acc, _, l = lax.fori_loop(hi, stop, masked, carry)
        lax.fori_loop(stop, cta_stop, skip, None)
        pl.when(wg == 0)(sync)
        acc = acc / lax.broadcast_in_dim(jnp.where(l == 0.0, 1.0, l), acc.shape, [0])
        qo_smem[...] = acc.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[row, pl.ds(q_base, block_q), head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(table_ref.at[row], table_smem, table_bar)
        plgpu.barrier_wait(table_bar)
        group = lax.div(head, jnp.array(rep, head.dtype))

        @pl.loop(cta_start, cta_stop)
        def _load(i):
            j = i - cta_start
            slot = lax.rem(j, stages)
            keys = (page_of(i), pl.ds(lax.rem(i * block_k, page_size), block_k), group)

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(k_free.at[slot])

            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_bar.at[slot])

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(v_free.at[slot])

            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_bar.at[slot])

        # Observe the last releases too, so no barrier completion goes unawaited when the scope ends (the
        # interpreter checks this; on hardware it is a short idle wait of the producer).
        @pl.loop(jnp.maximum(cta_stop - stages, cta_start), cta_stop)
        def _drain(i):
            slot = lax.rem(i - cta_start, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


@functools.partial(jax.jit, static_argnames=("window", "block_q", "block_k", "stages", "interpretable", "ping_pong"))
def paged_attention_prefill_mgpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    first_page: jax.Array,
    q_positions: jax.Array,
    window: int | None = None,
    block_q: int = 64,
    block_k: int = 64,
    stages: int = 3,
    interpretable: bool = False,
    ping_pong: bool = True,
) -> jax.Array:
    """Mosaic GPU version (experimental, see above). Arguments as in the reference op; bf16/f16 only.
    block_q: query rows per compute warpgroup (64: the wgmma M); block_k: keys per step (a multiple of 64 dividing
    the page size); stages: SMEM ring depth. ``interpretable`` selects the formulation GPU interpret mode can run
    (P through SMEM, fresh accumulators) instead of FA3's register-operand P @ V; ``ping_pong`` the FA3 schedule
    barrier between the two compute warpgroups."""
    _check_inputs(q, k_pages, v_pages, block_table, first_page, q_positions)
    if not mgpu_supported(q, k_pages, block_k):
        raise ValueError(
            f"Mosaic GPU kernel needs bf16/f16, head dim a multiple of 64 (<= 256) and block_k={block_k} dividing "
            f"the page size {k_pages.shape[1]}; got {q.dtype}, {q.shape[-1]}"
        )
    if block_q % 64 or block_k % 64:
        raise ValueError(f"block_q={block_q} and block_k={block_k} must be multiples of 64 (wgmma)")
    if stages < 2:
        # One slot would make a warpgroup's wait for the next K depend on the other's release of the same slot.
        raise ValueError(f"stages={stages} must be >= 2")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    rows, length, heads, head_dim = q.shape
    page_size, groups = k_pages.shape[1], k_pages.shape[2]
    width = block_table.shape[1]
    tile = 2 * block_q
    padded = -(-length // tile) * tile
    rel = q_positions.astype(jnp.int32) - first_page.astype(jnp.int32)[:, None] * page_size
    if padded != length:
        q = jnp.pad(q, ((0, 0), (0, padded - length), (0, 0), (0, 0)))
        rel = jnp.pad(rel, ((0, 0), (0, padded - length)), mode="edge")
    bounds = _mgpu_bounds(rel, width * page_size, block_q, block_k, window)
    # The table row goes to SMEM in one TMA: 16-byte multiple (pad with empty entries).
    table_width = -(-width // 4) * 4
    table = jnp.pad(block_table.astype(jnp.int32), ((0, 0), (0, table_width - width)))

    swizzle = 128 if head_dim % 64 == 0 else 64
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(q.dtype).itemsize)), plgpu.SwizzleTransform(swizzle))
    p_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    body = functools.partial(
        _mgpu_body, block_q=block_q, block_k=block_k, page_size=page_size, rep=heads // groups,
        scale=head_dim**-0.5, window=window, stages=stages, interpretable=interpretable, ping_pong=ping_pong,
        dtype=q.dtype,
    )

    def entry(table_ref, bounds_ref, rel_ref, q_ref, k_ref, v_ref, out_ref):
        pl.run_scoped(
            lambda *scratch: body(table_ref, bounds_ref, rel_ref, q_ref, k_ref, v_ref, out_ref, scratch),
            (
                plgpu.SMEM((2, block_q, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((stages, block_k, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((stages, block_k, head_dim), q.dtype, transforms=transforms),
                plgpu.SMEM((2, block_q, block_k), q.dtype, transforms=p_transforms),
                plgpu.SMEM((table_width,), jnp.int32),
            ),
            (
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=2),
                plgpu.Barrier(),
            ),
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(heads, padded // tile, rows),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(table, bounds, rel, q, k_pages, v_pages)
    return out[:, :length] if padded != length else out


def paged_attention_mosaic(q, k_pages, v_pages, block_table, first_page, q_positions, window=None):
    """Alternative dispatch entry, for once the Mosaic GPU kernel has been checked on a GPU: it where the shapes
    suit it (bf16/f16, head dim a multiple of 64, page size a multiple of 64, at least one full 128-row tile of
    new tokens), else the Triton entry (which itself falls back to the jnp op)."""
    if q.ndim == 4 and q.shape[1] >= 128 and k_pages.ndim == 4 and mgpu_supported(q, k_pages, 64):
        return paged_attention_prefill_mgpu(q, k_pages, v_pages, block_table, first_page, q_positions, window)
    return paged_attention(q, k_pages, v_pages, block_table, first_page, q_positions, window)
