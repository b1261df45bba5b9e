"""Paged attention for decode (one query token per sequence) in Pallas (Triton backend): flash-decoding over the
page pool, read through the block tables.

Layout (the same as the reference ``apriel2_jax.ops.paged_attention.paged_attention``): ``k_pages``/``v_pages``
[P, page_size, G, D]; ``block_table`` [B, M] lists page ids by logical page index from ``first_page[b]``; table
entries equal to the sink page (0) are empty; a key's position is implied by (logical page, offset).

Design. Decode attention is memory-bound: every visible K/V byte is read once and nothing else of that size
moves, so the kernel is judged by the fraction of HBM bandwidth it reaches. One program per (row, KV head,
K-split):

- All ``rep = H / G`` query heads of the KV head are handled together, as the rows of one [R, D] tile (R = rep
  rounded up to a power of two, at least 16, the minimum dot size): K/V are read once per KV head, not once per
  query head. Padded rows load zeros and are never stored.
- The program walks its share of the row's *visible* keys only: positions from
  ``max(first_page * page_size, p - window + 1)`` to ``p`` (pages from ``max(first_page, (p - window + 1) //
  page_size)`` to ``p // page_size``). Sliding-window rows skip what slid out and short rows skip the table's
  tail, so the work follows the visible context, not the table width.
- Each iteration gathers a block of ``block_tokens`` consecutive positions (N, a power of two; a block may span
  several pages or part of one, so any power-of-two page size works with the same tile) with one pointer
  tensor: position t reads row ``page_id(t // page_size) * page_size + t % page_size`` of the pool viewed as
  [P * page_size, G * D], columns ``g * D ...``. Each token row of one head is D contiguous elements (256 bytes at
  D = 128, bf16), so loads vectorise and coalesce whatever the page order. Loads are masked per token (keys past
  the query position, outside the window, in empty table entries, or past the split's end are not read at all and
  load zeros, so stale or NaN contents of the sink page never reach the output).
  The loop has a dynamic trip count; Triton software-pipelines it (``num_stages``) with asynchronous copies, which
  keeps several blocks of K/V in flight per program. The page ids of a block are loaded one iteration ahead and
  carried, so the K/V addresses never wait on a table load of the same iteration (``prefetch_ids``). They are
  loaded either as one gathered id per key (``page_ids="vector"``) or, with the blocks aligned to the page grid,
  as one scalar per page the block covers, from which each layout builds its rows and masks by arithmetic
  (``"scalar"``, the default at one or two rows). The ids are needed in two layouts (the K/V loads' and the
  scores'): gathered ids are converted through shared memory between them or gathered once per layout, which
  Triton chooses (at 32 rows and 128-token blocks: 12 layout conversions against 5 with scalar ids; at one row
  and 64-token blocks the ids are gathered twice, one gather not prefetched).
- Online softmax in fp32 (scores scaled by D^-0.5, exp2 with log2(e) folded in). Masked scores are -inf while the
  running max starts at a finite -1e30, so exp never sees inf - inf and a row with no visible key ends with l = 0,
  which the epilogue turns into a zero output instead of NaN.
- With one split the program writes the normalised output directly. With several splits each writes its partial
  (unnormalised accumulator, running max, running sum) in fp32, merged by a small kernel (``merge_splits``) at one
  or two rows, by XLA above (``MERGE_KERNEL_MAX_ROWS``).

Splits: B * G programs already fill the GPU at a large batch; small batches or long contexts need more. The
default picks the smallest count giving at least ``min_programs`` programs, capped so each split keeps at least
two blocks of the widest possible visible range (``choose_splits``); at one or two rows, splits of one block as
long as the programs fit in one wave (``default_schedule``). All block sizes are static kwargs so the
benchmark can sweep them (``scripts/bench_attention.py --sweep``).

fp32 inputs use IEEE (precision HIGHEST) dots so the kernel matches the fp32 reference to ~1e-6; bf16/f16 inputs
use the tensor cores with fp32 accumulation (more precise than the reference, which rounds scores to bf16).
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from apriel2_jax.ops.paged_attention import check_paged_inputs

F32 = jnp.float32
_LOG2E = math.log2(math.e)
_M_INIT = -1e30  # finite start for the running max: exp2(-inf - m) = 0 with no inf - inf
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def unsupported_reason(q, k_pages, v_pages, block_table, first_page, q_positions) -> str | None:
    """Why the kernel cannot take these inputs (None when it can). Shape errors in the inputs themselves are
    raised by ``paged_attention_decode``; this only covers what the kernel chooses not to handle."""
    if q.ndim != 4 or q.shape[1] != 1:
        return "the kernel handles one query token per sequence (decode)"
    if k_pages.ndim != 4:
        return "k_pages must be [P, page_size, G, D]"
    head_dim = q.shape[-1]
    page_size = k_pages.shape[1]
    if not (_is_power_of_two(head_dim) and head_dim >= 16):
        return f"head_dim {head_dim} must be a power of two >= 16 (Triton loads and dots)"
    if not _is_power_of_two(page_size):
        return f"page_size {page_size} must be a power of two"
    if jnp.dtype(q.dtype) not in _DTYPES or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        return f"dtypes q={q.dtype} k={k_pages.dtype} v={v_pages.dtype}: need one of f32/bf16/f16 for all three"
    if k_pages.shape[2] == 0 or q.shape[2] % k_pages.shape[2]:
        return "the query heads must be a multiple of the KV heads"
    return None


def _check_inputs(q, k_pages, v_pages, block_table, first_page, q_positions, window):
    check_paged_inputs(q, k_pages, v_pages, block_table, first_page, q_positions)
    if window is not None and (not isinstance(window, numbers.Integral) or window < 1):
        raise ValueError(f"window must be None or a positive int, got {window!r}")


# Two regimes of the default schedule, measured in the engine at the 0.5B geometry (D = 64, G = 2, context 1024;
# H200, 2026-11-27, ms per step, all-attention / a12-g1-k11). While the programs fit in one wave of the GPU's SMs
# (one row: 18 programs) each program runs alone and latency rules: 64-token blocks in splits of two blocks (9
# splits) gave B=1 0.698 / 0.846-0.849 against 0.710-0.713 / 0.854-0.855 with 128-token blocks in 4 splits. Past
# one wave, per-program fixed costs and the split-K merge rule: 128-token blocks in 4 splits gave B=8 0.855-0.870
# / 1.054-1.057 against 0.880-0.881 / 1.060-1.070, and B=32 1.125-1.128 / 1.302-1.304 against 1.191 / 1.342-1.351.
ONE_WAVE_PROGRAMS = 132  # an H100's or H200's SM count
# Key positions one loop iteration gathers at 2-byte dtypes, by regime: 64 tokens while latency rules; past one
# wave, 16 KB of K (and as much of V) per KV head: 128 tokens at D = 64, 64 (the same) from D = 128 up.
LATENCY_BLOCK_TOKENS = 64
THROUGHPUT_BLOCK_ELEMENTS = 8192
MIN_BLOCKS_PER_SPLIT = 2  # a split shorter than two blocks pays its fixed cost and its share of the merge for little
# Rows up to which the splits are merged by ``merge_splits`` (one kernel), above by XLA (``merge_splits_xla``: a
# fusion of its own, which XLA does not fuse into the output projection's GEMM after it). Above two rows the kernel
# was not faster. In the engine (0.5B, context 1024, H100, 2026-11-28, alternating processes) the kernel took
# all-attention B=1 from 0.782, 0.782 to 0.769, 0.754 ms and a12-g1-k11 B=1 from 0.780, 0.786 to 0.778, 0.779; at
# B=32 it gave 1.121, 1.111 against 1.113, 1.113 (all-attention) and 1.167, 1.164 against 1.157, 1.149
# (a12-g1-k11). Two rows were not measured.
MERGE_KERNEL_MAX_ROWS = 2
# Rows up to which the schedule is cut for latency alone: splits of one block (as many as fit in one wave) and each
# block's page ids loaded as scalars (``page_ids="scalar"``, at most ``MAX_SCALAR_PAGE_IDS`` of them) instead of
# one gathered id per key in each layout that needs them, and a shorter chain per program. In the engine (0.5B,
# context 1024, H200, 2026-11-29, alternating processes, ms per step, with / without both): all-attention B=1
# 0.619, 0.613 / 0.632, 0.629, B=2 0.726, 0.725 / 0.739, 0.744, a12-g1-k11 B=1 0.631, 0.632 / 0.638, 0.637, B=2
# 0.770, 0.765 / 0.776, 0.776. At 4 rows (16 splits, XLA's merge) the step was slower: all-attention 0.908,
# 0.908 / 0.875, 0.872. At 32 rows (128-token blocks) scalar ids were slower in the chained-layer benchmark
# (11.1-11.4 against 10.5-11.2 µs per layer): 8 ids per block, 128 registers against 96 (sm_90, pip triton 3.6).
LATENCY_ROWS = 2
MAX_SCALAR_PAGE_IDS = 8
# At one row, blocks of this many tokens where one wave holds a split for each of them: twice the programs, each a
# shorter chain. In the engine (0.5B: D = 64, 2 KV heads, context 1024, 73-page tables: 36 splits of 32 tokens
# against 18 of 64; H200, 2026-11-29, alternating processes, ms per step, 32 / 64): all-attention B=1 0.601, 0.602
# / 0.618, 0.608, a12-g1-k11 0.627, 0.625 / 0.627, 0.630. Other geometries (D = 128, 8 KV heads at short
# contexts) take the same rule unmeasured. At two rows one wave holds 33 splits, fewer than the 36 blocks, so most
# of the engine's rows ran 18 splits of two 32-token blocks: no gain (all-attention 0.715, 0.718 / 0.714, 0.706,
# a12-g1-k11 0.762, 0.754 / 0.760, 0.757); two rows keep 64-token blocks.
ONE_ROW_BLOCK_TOKENS = 32


def choose_splits(batch: int, groups: int, max_tokens: int, block_tokens: int,
                  min_programs: int = 1024, min_tokens_per_split: int | None = None) -> int:
    """Number of K-splits: enough programs to fill the GPU (several waves of 132 SMs, so the tail wave is short)
    without splits so short that the per-split fixed cost and the combine dominate. ``max_tokens``: the widest
    visible range a row can have (the table's span, or the window). Each split spans at least
    ``min_tokens_per_split`` tokens (default: ``MIN_BLOCKS_PER_SPLIT`` blocks, and 128): in the engine's decode at
    B=1, context 1024 (0.5B geometry, H200) splits of 128 tokens gave a 1.19 ms step, 512 gave 1.30 ms."""
    if min_tokens_per_split is None:
        min_tokens_per_split = max(128, MIN_BLOCKS_PER_SPLIT * block_tokens)
    want = -(-min_programs // (batch * groups))
    most = max(1, max_tokens // max(min_tokens_per_split, block_tokens))
    return max(1, min(want, most))


def default_schedule(batch: int, groups: int, max_tokens: int, head_dim: int, dtype,
                     min_programs: int = 1024, window_page_size: int | None = None) -> tuple[int, int]:
    """(block_tokens, splits) of the kernel's defaults. fp32: 32-token blocks (its IEEE dots run on FMAs and need
    the registers). 2-byte dtypes: ``LATENCY_BLOCK_TOKENS`` where the programs they give fit in one wave
    (``ONE_WAVE_PROGRAMS``), else throughput-regime blocks (``THROUGHPUT_BLOCK_ELEMENTS``); splits by
    ``choose_splits``, down to one block each up to ``LATENCY_ROWS`` rows while the programs fit in one wave, at
    one row blocks of ``ONE_ROW_BLOCK_TOKENS`` where one wave holds a split for each. ``window_page_size``: the
    page size where the visible range is a window that can start mid-page: scalar page ids start its first block
    on the page grid, up to min(block, page_size) - 1 tokens before it, and the splits cover those too."""
    if jnp.dtype(dtype) == jnp.float32:
        block = 32
        return block, choose_splits(batch, groups, max_tokens, block, min_programs)
    block = LATENCY_BLOCK_TOKENS
    splits = choose_splits(batch, groups, max_tokens, block, min_programs)
    if batch * groups * splits > ONE_WAVE_PROGRAMS:
        # At most 128 tokens: the [R, N] scores' registers.
        block = min(128, max(block, _next_power_of_two(THROUGHPUT_BLOCK_ELEMENTS // head_dim)))
        return block, choose_splits(batch, groups, max_tokens, block, min_programs)
    if batch > LATENCY_ROWS:
        return block, splits
    # Splits as short as one block while the programs still fit in one wave (each program's chain of dependent
    # loads is the cost, and more programs shorten it): as many as the widest visible range has whole blocks (a
    # row past the last whole block gets splits of two), or, for a window, blocks covering it on the page grid (a
    # window of 1024 starting mid-page spans 17 blocks of 64, 33 of 32).
    wave_splits = ONE_WAVE_PROGRAMS // (batch * groups)

    def block_count(size):
        if window_page_size is None:
            return max(1, max_tokens // size)
        return -(-(max_tokens + min(size, window_page_size) - 1) // size)

    if batch == 1 and block_count(ONE_ROW_BLOCK_TOKENS) <= wave_splits:
        block = ONE_ROW_BLOCK_TOKENS
        splits = choose_splits(batch, groups, max_tokens, block, min_programs)
    return block, max(splits, min(block_count(block), wave_splits))


def _widest_visible(width: int, page_size: int, window: int | None) -> int:
    """The most keys a row can see: its table's span, or the window."""
    return width * page_size if window is None else min(width * page_size, window)


def table_schedule(batch: int, groups: int, width: int, page_size: int, window: int | None, head_dim: int, dtype,
                   min_programs: int = 1024) -> tuple[int, int]:
    """``default_schedule`` for tables of ``width`` pages and an optional window: the kernel's defaults."""
    max_tokens = _widest_visible(width, page_size, window)
    # A window narrower than the table can start mid-page, where scalar ids start a block on the page grid.
    mid_page = window is not None and window < width * page_size
    return default_schedule(batch, groups, max_tokens, head_dim, dtype, min_programs,
                            window_page_size=page_size if mid_page else None)


def _kernel(pos_ref, first_ref, table_ref, q_ref, k_ref, v_ref, *refs, rep, rows, page_size, block_tokens,
            width, head_dim, window, splits, scale, precision, heads, groups, interpret, prefetch_ids, page_ids,
            new_token):
    # Grid (G, splits, B): the launch order runs the G heads of one (row, split) side by side, so programs that
    # run together read whole [G * D] token rows of the pool between them (DRAM locality).
    g, s, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pos = pos_ref[b]
    first = first_ref[b]

    if new_token == "packed":  # q_ref holds the query heads, then the G new keys, then the G new values
        cos_ref, sin_ref, slot_ref, *out_refs = refs
        kn_ref, kn_head, vn_ref, vn_head = q_ref, heads + g, q_ref, heads + groups + g
    elif new_token:
        kn_ref, vn_ref, cos_ref, sin_ref, slot_ref, *out_refs = refs
        kn_head = vn_head = g
    else:
        out_refs = refs

    # Visible key positions: [lo, hi), inside the table's span [first * page_size, (first + width) * page_size).
    hi = jnp.clip(pos + 1, first * page_size, (first + width) * page_size)
    lo = first * page_size if window is None else jnp.clip(pos - window + 1, first * page_size, hi)
    if new_token:
        # The new token (position pos) comes from the inputs, not the pages it is written to in this kernel: the
        # loop covers [lo, pos) and split 0 starts its softmax from the new key. The key is visible where the
        # reference would see it: inside the range, its page a real table entry.
        column = jnp.clip(pos // page_size - first, 0, width - 1)
        new_ok = (pos >= lo) & (pos < hi) & (table_ref[b, column] != 0)
        hi = jnp.minimum(hi, pos)
    # This split's share, a whole number of blocks so only the last block of the last split is partial. With
    # scalar page ids the blocks start on the page grid (at multiples of min(N, page_size) tokens), so each block
    # covers whole pages or lies inside one; the keys before lo in the first block are masked.
    base = lo
    if page_ids == "scalar":
        align = min(block_tokens, page_size)
        base = lo - lo % align
    chunk = pl.cdiv(pl.cdiv(jnp.maximum(hi - base, 0), splits), block_tokens) * block_tokens
    start = base + s * chunk
    end = jnp.minimum(start + chunk, hi)
    iters = pl.cdiv(jnp.maximum(end - start, 0), block_tokens)

    r = jnp.arange(rows, dtype=jnp.int32)
    row_ok = r < rep
    q_rows = jnp.minimum(g * rep + r, g * rep + rep - 1)  # padded rows re-read a real row, then get zeroed
    cols = jnp.arange(head_dim, dtype=jnp.int32)
    q = pltriton.load(q_ref.at[b, q_rows[:, None], cols[None, :]], mask=row_ok[:, None], other=0)
    kv_cols = g * head_dim + cols
    if new_token:
        # RoPE as ``ops.rope.apply_rope``: x * cos + rotate_half(x) * sin, each op rounded to the dtype.
        half = head_dim // 2
        swapped = (cols + half) % head_dim
        sign = jnp.where(cols < half, -1.0, 1.0).astype(F32)
        cos = cos_ref[b, :].astype(F32)
        sin = sin_ref[b, :].astype(F32)

        def rope(x, x_swapped):
            a = (x.astype(F32) * cos).astype(x.dtype).astype(F32)
            c = ((sign * x_swapped.astype(F32)) * sin).astype(x.dtype).astype(F32)
            return (a + c).astype(x.dtype)

        q_swapped = pltriton.load(q_ref.at[b, q_rows[:, None], swapped[None, :]], mask=row_ok[:, None], other=0)
        q = rope(q, q_swapped)
        k_new = rope(kn_ref[b, kn_head, :], pltriton.load(kn_ref.at[b, kn_head, swapped]))
        v_new = vn_ref[b, vn_head, :]
        k_out_ref, v_out_ref = out_refs[-2:]
        out_refs = out_refs[:-2]

        @pl.when(s == 0)
        def _():
            slot = slot_ref[b]

            @pl.when(slot >= page_size)  # padding rows' slots are in the sink page, which is never written
            def _():
                pltriton.store(k_out_ref.at[slot, kv_cols], k_new)
                pltriton.store(v_out_ref.at[slot, kv_cols], v_new)

    tok = jnp.arange(block_tokens, dtype=jnp.int32)

    pages_per_block = max(1, block_tokens // page_size)

    def block_ids(i):
        """What block i's loads need from the table, loaded ``prefetch_ids`` iterations ahead. "vector": its pool
        rows and visibility [N] (one gathered id per key; repeats hit L1). "scalar": one id per page the block
        covers, from which every layout builds its rows and masks by arithmetic."""
        block_start = start + i * block_tokens
        if page_ids == "scalar":
            column = block_start // page_size - first
            return tuple(table_ref[b, jnp.clip(column + j, 0, width - 1)] for j in range(pages_per_block))
        key_pos = block_start + tok  # [N] positions
        column = key_pos // page_size - first  # shifts: page_size is a power of two
        page = table_ref[b, jnp.clip(column, 0, width - 1)]  # [N] page ids
        # Every position in [start, end) is visible (causality and the window are in the range) unless its table
        # entry is empty.
        return page * page_size + key_pos % page_size, (key_pos < end) & (page != 0)

    def block_rows(i, ids):
        """Pool rows [N] of block i's keys and the keys' visibility."""
        if page_ids != "scalar":
            return ids
        key_pos = start + i * block_tokens + tok
        page = ids[0]
        for j in range(1, pages_per_block):
            page = jnp.where(tok >= j * page_size, ids[j], page)
        # The first block may start before lo (blocks on the page grid).
        valid = (key_pos >= lo) & (key_pos < end) & (page != 0)
        return page * page_size + key_pos % page_size, valid

    def body(i, carry):
        acc, m, l = carry[:3]
        if prefetch_ids:
            # The ids of block i came from an earlier iteration (``prefetch_ids`` blocks ahead): the K/V
            # addresses do not wait on a load of this iteration, so Triton's pipeliner can issue the K/V copies
            # for later blocks without stalling on the table, and keep num_stages - 1 blocks in flight.
            ids = carry[3:3 + len_ids]
            queue = (*carry[3 + len_ids:], *block_ids(i + prefetch_ids))
        else:
            ids = block_ids(i)
            queue = ()
        kv_row, valid = block_rows(i, ids)
        kv_rows = kv_row[:, None]
        k = pltriton.load(k_ref.at[kv_rows, kv_cols[None, :]], mask=valid[:, None], other=0)
        v = pltriton.load(v_ref.at[kv_rows, kv_cols[None, :]], mask=valid[:, None], other=0)
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=F32)  # [R, N]
        scores = jnp.where(valid[None, :], scores * (scale * _LOG2E), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(scores - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=F32)  # [R, D]
        return (acc * alpha[:, None] + pv, m_new, l, *queue)

    init = (jnp.zeros((rows, head_dim), F32), jnp.full((rows,), _M_INIT, F32), jnp.zeros((rows,), F32))
    if new_token:
        first_split = jnp.broadcast_to(new_ok & (s == 0), (rows,))
        score = jnp.sum(q.astype(F32) * k_new.astype(F32)[None, :], axis=1) * (scale * _LOG2E)  # [R]
        init = (
            jnp.where(first_split[:, None], jnp.broadcast_to(v_new.astype(F32)[None, :], (rows, head_dim)), 0.0),
            jnp.where(first_split, score, _M_INIT),
            first_split.astype(F32),
        )
    len_ids = pages_per_block if page_ids == "scalar" else 2
    for j in range(prefetch_ids):
        init += block_ids(j)
    acc, m, l = jax.lax.fori_loop(0, iters, body, init)[:3]

    # Padded rows are masked off, so on the GPU their addresses are never written (any in-bounds row will do).
    # The interpreter instead writes back the old contents at masked lanes, in one scatter, where a duplicate
    # of a real row could win; there the padded rows point at spare rows past the H real ones.
    spare = heads + r if interpret else g * rep + rep - 1
    out_rows = jnp.where(row_ok, g * rep + r, spare)
    if splits == 1:
        (o_ref,) = out_refs
        out = jnp.where((l > 0)[:, None], acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
        pltriton.store(o_ref.at[b, out_rows[:, None], cols[None, :]], out.astype(o_ref.dtype), mask=row_ok[:, None])
    else:
        o_ref, m_ref, l_ref = out_refs
        pltriton.store(o_ref.at[b, s, out_rows[:, None], cols[None, :]], acc, mask=row_ok[:, None])
        pltriton.store(m_ref.at[b, s, out_rows], m, mask=row_ok)
        pltriton.store(l_ref.at[b, s, out_rows], l, mask=row_ok)


_STATIC = ("window", "block_tokens", "splits", "num_warps", "num_stages", "min_programs", "prefetch_ids", "page_ids",
           "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_attention_decode(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    first_page: jax.Array,
    q_positions: jax.Array,
    window: int | None = None,
    *,
    block_tokens: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
    min_programs: int = 1024,
    prefetch_ids: int = 1,
    page_ids: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """q: [B, 1, H, D]; k_pages, v_pages: [P, page_size, G, D]; block_table: [B, M] page ids; first_page: [B];
    q_positions: [B, 1]. Returns [B, 1, H, D] in q's dtype (the reference op's contract, for T = 1).

    block_tokens: key positions gathered per loop iteration, a power of two >= 16 (the dot's minimum) (default:
    ``default_schedule``: 64 tokens, or 128 at D = 64 past one wave of programs, 32 at one row where one wave holds
    a split per block; 32 for fp32); splits: K-splits per (row, KV head) (default: ``default_schedule``'s);
    num_warps (default 4, 8 for fp32, whose IEEE dots run on FMAs and need the registers) / num_stages: Triton's;
    prefetch_ids: how many blocks ahead the page ids are loaded (0: in the same iteration as their K/V). With Triton
    3.6, 1 lets the pipeliner keep num_stages - 1 K/V blocks in flight; 0 leaves one (the K/V addresses wait on the
    table load) and 2 defeats the pipeliner (synchronous K/V loads); page_ids: "scalar" (one id per page a block
    covers, blocks on the page grid) or "vector" (one gathered id per key); default: "scalar" up to ``LATENCY_ROWS``
    rows while the programs fit in one wave and a block covers at most ``MAX_SCALAR_PAGE_IDS`` pages, else "vector".
    Swept by the benchmark.
    """
    _check_inputs(q, k_pages, v_pages, block_table, first_page, q_positions, window)
    out, _ = _launch(q[:, 0], k_pages, v_pages, block_table, first_page, q_positions, window, None,
                     block_tokens=block_tokens, splits=splits, num_warps=num_warps, num_stages=num_stages,
                     min_programs=min_programs, prefetch_ids=prefetch_ids, page_ids=page_ids, interpret=interpret)
    return out[:, None]


@functools.partial(jax.jit, static_argnames=_STATIC)
def rope_write_paged_attention_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    slots: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    first_page: jax.Array,
    q_positions: jax.Array,
    window: int | None = None,
    *,
    block_tokens: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
    min_programs: int = 1024,
    prefetch_ids: int = 1,
    page_ids: str | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The decode step of an attention layer after its projections, in one kernel: RoPE on the new query and key,
    the new key and value written to their page slot, and attention over the pages plus the new token (the
    reference ``apriel2_jax.ops.paged_attention.rope_write_paged_attention``). q: [B, H, D]; k, v: [B, G, D]
    (before RoPE), or k = v = None with q [B, H + 2G, D] holding the keys and values after the query heads;
    cos, sin: [B, D]; slots: [B] flat page slot of each row's token (padding rows: the sink page, not written);
    the rest and the keyword options as ``paged_attention_decode``. Returns the output [B, H, D] and the pages,
    updated in place (the pool buffers are aliased to the outputs).

    Attention never reads the slot written here: its loop covers the keys before the new position, and the new
    key and value enter split 0's softmax from registers, so no program waits on another's write."""
    packed = k is None and v is None
    batch, heads, head_dim = q.shape
    groups = k_pages.shape[2] if k_pages.ndim == 4 else 1
    if packed:
        heads -= 2 * groups
        if heads <= 0:
            raise ValueError(f"q must be [B, H + 2G, D] with G = {groups} KV heads when k and v are None, got "
                             f"{list(q.shape)}")
    _check_inputs(jax.ShapeDtypeStruct((batch, 1, heads, head_dim), q.dtype), k_pages, v_pages, block_table,
                  first_page, q_positions, window)
    named = (("cos", cos, (batch, head_dim)), ("sin", sin, (batch, head_dim)))
    if not packed:
        named += (("k", k, (batch, groups, head_dim)), ("v", v, (batch, groups, head_dim)))
    for name, x, shape in named + (("slots", slots, (batch,)),):
        if x is None or x.shape != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {None if x is None else list(x.shape)}")
    for name, x, _ in named:
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    new_token = (cos, sin, slots.astype(jnp.int32)) if packed else (k, v, cos, sin, slots.astype(jnp.int32))
    out, pages = _launch(q, k_pages, v_pages, block_table, first_page, q_positions, window, new_token,
                         packed=packed, block_tokens=block_tokens, splits=splits,
                         num_warps=num_warps, num_stages=num_stages, min_programs=min_programs,
                         prefetch_ids=prefetch_ids, page_ids=page_ids, interpret=interpret)
    return out, *pages


def _launch(q, k_pages, v_pages, block_table, first_page, q_positions, window, new_token, *, packed: bool = False,
            block_tokens: int | None = None, splits: int | None = None, num_warps: int | None = None,
            num_stages: int = 3, min_programs: int = 1024, prefetch_ids: int = 1, page_ids: str | None = None,
            interpret: bool = False):
    """q: [B, H, D] (``packed``: [B, H + 2G, D], the new keys and values after the query heads). Returns the
    output [B, H, D] and, with ``new_token`` = (k, v, cos, sin, slots) (``packed``: (cos, sin, slots)), the pages
    with the new keys and values written (else None)."""
    num_pages, page_size, groups, _ = k_pages.shape
    batch, heads, head_dim = q.shape
    if packed:
        heads -= 2 * groups
    reason = unsupported_reason(jax.ShapeDtypeStruct((batch, 1, heads, head_dim), q.dtype), k_pages, v_pages,
                                block_table, first_page, q_positions)
    if reason is not None:
        raise ValueError(f"paged_attention_decode: {reason}")
    width = block_table.shape[1]
    rep = heads // groups
    fp32 = q.dtype == jnp.float32
    max_tokens = _widest_visible(width, page_size, window)
    if block_tokens is None:
        block_tokens, auto_splits = table_schedule(batch, groups, width, page_size, window, head_dim, q.dtype,
                                                   min_programs)
        splits = auto_splits if splits is None else splits
    if num_warps is None:
        num_warps = 8 if fp32 else 4
    if not (_is_power_of_two(block_tokens) and block_tokens >= 16):
        raise ValueError(f"block_tokens={block_tokens} must be a power of two >= 16 (Triton blocks, dot sizes)")
    if splits is None:
        splits = choose_splits(batch, groups, max_tokens, block_tokens, min_programs)
    if splits < 1:
        raise ValueError(f"splits={splits} must be >= 1")
    if prefetch_ids not in (0, 1, 2):
        raise ValueError(f"prefetch_ids={prefetch_ids} must be 0, 1 or 2 (blocks of page ids loaded ahead)")
    if page_ids is None:
        latency = batch <= LATENCY_ROWS and batch * groups * splits <= ONE_WAVE_PROGRAMS
        page_ids = "scalar" if latency and block_tokens // page_size <= MAX_SCALAR_PAGE_IDS else "vector"
    if page_ids not in ("scalar", "vector"):
        raise ValueError(f"page_ids={page_ids!r} must be 'scalar', 'vector' or None (the default: see "
                         "paged_attention_decode)")

    rows = max(16, _next_power_of_two(rep))  # the dot's M: the group's query heads, padded
    kernel = functools.partial(
        _kernel, rep=rep, rows=rows, page_size=page_size,
        block_tokens=block_tokens, width=width, head_dim=head_dim, window=window, splits=splits,
        scale=head_dim**-0.5,
        precision=jax.lax.Precision.HIGHEST if fp32 else None, heads=heads, groups=groups, interpret=interpret,
        prefetch_ids=prefetch_ids, page_ids=page_ids,
        new_token=None if new_token is None else "packed" if packed else "separate",
    )
    out_heads = heads + rows if interpret else heads  # spare rows for the interpreter (see the kernel's stores)
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((batch, out_heads, head_dim), q.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((batch, splits, out_heads, head_dim), F32),
            jax.ShapeDtypeStruct((batch, splits, out_heads), F32),
            jax.ShapeDtypeStruct((batch, splits, out_heads), F32),
        ]
    # Pool viewed as token rows [P * page_size, G * D] (a free reshape): one gather index per token.
    k_rows = k_pages.reshape(num_pages * page_size, groups * head_dim)
    v_rows = v_pages.reshape(num_pages * page_size, groups * head_dim)
    inputs = [q_positions[:, 0].astype(jnp.int32), first_page.astype(jnp.int32), block_table.astype(jnp.int32), q,
              k_rows, v_rows]
    aliases = {}
    name = f"paged_attention_decode_ps{page_size}_n{block_tokens}_s{splits}" + ("_scalar" if page_ids == "scalar"
                                                                                else "")
    if new_token is not None:
        inputs += list(new_token)
        aliases = {4: len(out_shape), 5: len(out_shape) + 1}  # the pools, written in place
        out_shape += [jax.ShapeDtypeStruct(k_rows.shape, k_rows.dtype), jax.ShapeDtypeStruct(v_rows.shape, v_rows.dtype)]
        name = "rope_write_" + name
    out = pl.pallas_call(
        kernel,
        grid=(groups, splits, batch),
        out_shape=tuple(out_shape),
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*inputs)
    pages = None
    if new_token is not None:
        pages = (out[-2].reshape(k_pages.shape), out[-1].reshape(v_pages.shape))
        out = out[:-2]
    if splits == 1:
        return out[0][:, :heads], pages
    if batch <= MERGE_KERNEL_MAX_ROWS:
        return merge_splits(*out, heads=heads, dtype=q.dtype, interpret=interpret), pages
    return merge_splits_xla(*(x[:, :, :heads] for x in out), dtype=q.dtype), pages


# Splits up to which XLA's merge is written one split after another (``merge_splits_xla``). Its compile time grows
# faster than the splits (XLA's CPU compile of one merge at 4 rows: 0.3 s at 16 splits, 0.7 s at 32, 7.1 s at 128,
# against 0.05-0.1 s with reductions; the GPU's not measured), and the default schedule gives up to ~170 splits at
# 3-4 rows of a long context. It was measured in the engine at 4-16 splits only.
UNROLLED_MERGE_MAX_SPLITS = 16


def merge_splits_xla(acc: jax.Array, m: jax.Array, l: jax.Array, *, dtype) -> jax.Array:
    """The merge ``_merge_kernel`` computes, in XLA (above ``MERGE_KERNEL_MAX_ROWS`` rows). Up to
    ``UNROLLED_MERGE_MAX_SPLITS`` splits it is written elementwise, one split after another (a fixed order), so
    XLA emits one loop fusion instead of reductions over a short axis. In the engine (0.5B all-attention, context
    1024, H200, 2026-11-29, alternating processes, ms per step, unrolled / reductions): B=4 (16 splits) 0.836,
    0.839 / 0.866, 0.857; B=32 (4 splits) 0.961, 0.963 / 0.968, 0.968; B=8 (8 splits) 0.806, 0.801 / 0.801,
    0.798. acc [B, S, H, D], m and l [B, S, H], fp32; returns [B, H, D] in ``dtype``."""
    splits = acc.shape[1]
    if splits > UNROLLED_MERGE_MAX_SPLITS:
        weights = jnp.exp2(m - jnp.max(m, axis=1, keepdims=True))
        l_sum = jnp.sum(weights * l, axis=1)
        o_sum = jnp.sum(weights[..., None] * acc, axis=1)
    else:
        m_max = m[:, 0]
        for s in range(1, splits):
            m_max = jnp.maximum(m_max, m[:, s])
        weights = [jnp.exp2(m[:, s] - m_max) for s in range(splits)]
        l_sum = weights[0] * l[:, 0]
        o_sum = weights[0][..., None] * acc[:, 0]
        for s in range(1, splits):
            l_sum = l_sum + weights[s] * l[:, s]
            o_sum = o_sum + weights[s][..., None] * acc[:, s]
    o = jnp.where((l_sum > 0)[..., None], o_sum / jnp.where(l_sum > 0, l_sum, 1.0)[..., None], 0.0)
    return o.astype(dtype)


def _merge_kernel(acc_ref, m_ref, l_ref, o_ref, *, splits, padded_splits, head_dim):
    # Flash-decoding's merge: each split rescaled to the common max. Empty splits have m = -1e30 and l = 0, so
    # they weigh nothing; a row with no visible key at all gets l = 0 and a zero output.
    b, h = pl.program_id(0), pl.program_id(1)
    s = jnp.arange(padded_splits, dtype=jnp.int32)
    real = s < splits
    s = jnp.minimum(s, splits - 1)  # padded lanes re-read a real split, then weigh nothing
    cols = jnp.arange(head_dim, dtype=jnp.int32)
    m = jnp.where(real, pltriton.load(m_ref.at[b, s, h]), -jnp.inf)
    l = pltriton.load(l_ref.at[b, s, h])
    acc = pltriton.load(acc_ref.at[b, s[:, None], h, cols[None, :]])
    w = jnp.exp2(m - jnp.max(m))
    l_sum = jnp.sum(w * l)
    o_sum = jnp.sum(w[:, None] * acc, axis=0)
    out = jnp.where(l_sum > 0, o_sum / jnp.where(l_sum > 0, l_sum, 1.0), 0.0)
    pltriton.store(o_ref.at[b, h, cols], out.astype(o_ref.dtype))


def merge_splits(acc: jax.Array, m: jax.Array, l: jax.Array, *, heads: int, dtype, interpret: bool = False
                 ) -> jax.Array:
    """The split partials (acc [B, S, H', D], running max and sum [B, S, H'], fp32; H' >= heads) merged into the
    output [B, heads, D] in ``dtype``, as one kernel: XLA runs the merge as two fusions (~1.1 and ~1.2 µs per
    attention layer at one row on an H200)."""
    batch, splits, _, head_dim = acc.shape
    kernel = functools.partial(_merge_kernel, splits=splits, padded_splits=max(16, _next_power_of_two(splits)),
                               head_dim=head_dim)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads),
        out_shape=jax.ShapeDtypeStruct((batch, heads, head_dim), dtype),
        compiler_params=pltriton.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="paged_attention_decode_merge",
    )(acc, m, l)


def paged_attention(q, k_pages, v_pages, block_table, first_page, q_positions, window=None):
    """The dispatch entry (the reference op's signature): the decode kernel for one query token per sequence when
    the Triton backend can take the shapes, the jnp reference op otherwise (prefill, odd head dims, ...)."""
    if unsupported_reason(q, k_pages, v_pages, block_table, first_page, q_positions) is not None:
        from apriel2_jax.ops.paged_attention import paged_attention as reference

        return reference(q, k_pages, v_pages, block_table, first_page, q_positions, window)
    window = None if window is None else int(window)  # a static jit argument: one compile per window width
    return paged_attention_decode(q, k_pages, v_pages, block_table, first_page, q_positions, window)


def rope_write_paged_attention(q, k, v, cos, sin, slots, k_pages, v_pages, block_table, first_page, q_positions,
                               window=None):
    """Dispatch entry for "rope_write_paged_attention": the fused kernel where the decode kernel takes the shapes,
    else the reference chain."""
    from apriel2_jax.ops import paged_attention as reference

    heads = q.shape[1] - (2 * k_pages.shape[2] if k is None else 0)
    query = jax.ShapeDtypeStruct((q.shape[0], 1, heads, q.shape[2]), q.dtype)
    if unsupported_reason(query, k_pages, v_pages, block_table, first_page, q_positions) is not None:
        return reference.rope_write_paged_attention(q, k, v, cos, sin, slots, k_pages, v_pages, block_table,
                                                    first_page, q_positions, window)
    window = None if window is None else int(window)
    return rope_write_paged_attention_decode(q, k, v, cos, sin, slots, k_pages, v_pages, block_table, first_page,
                                             q_positions, window)
