"""Paged attention for decode (one query token per sequence) as a Mosaic GPU kernel: K/V pages streamed by TMA into
a ring of shared-memory stages, scores and outputs on wgmma. Same contract as ``paged_attention_decode`` (the
Triton kernel) without the new token's RoPE and page write; the jnp oracle is ``apriel2_jax.ops.paged_attention.
paged_attention``.

Why. Past one wave of programs the Triton kernel streams K/V at ~1.8 TB/s (0.5B geometry, 32 rows: 16.8 MB per
layer in ~9.4 µs, docs/BENCHMARKS.md): each program gathers 128-byte token rows through registers-addressed
asynchronous copies. A TMA copy moves a page's [page_size, D] slice of one KV head as one bulk transfer.

Design. One CTA per (KV head g, K-split s, row b), as the Triton kernel's grid:
- It loads the row's position and first page, then the split's page ids (one TMA of the table row's slice; the
  caller pads the table so the slice never runs past it), then issues the first ``depth`` blocks of 64 key
  positions: for each page of a block, one TMA of its [page_size, D] K slice and one of its V slice. Table entries
  equal to the sink page (0) load another page of their block instead and their keys are masked, so no stale or
  NaN contents of the sink page reach a product; a block of empty entries only (padding rows) has its product
  dropped.
- The group's query heads (padded to 8, the rows of a [64, D] wgmma A operand) against the block's keys: S = Q K^T
  [64, 64], masked to the split's visible positions and non-empty pages, online softmax in fp32 with exp2 (scores
  scaled by D^-0.5 log2(e); the running max starts at a finite -1e30 so exp2 never sees inf - inf), then
  O += P V with P from registers. A stage is refilled once its P V is done.
- Each CTA writes its unnormalised output rows, running max and sum (the Triton kernel's partials); XLA merges the
  splits in the same fusion as for the Triton kernel.
Rows 8..63 of the A operand are padding the wgmma needs and are never read back.

Status: not registered. Equal to the oracle in Mosaic GPU's interpret mode on the CPU (the tests) and to the
Triton kernel on an H200 at the 0.5B geometry (32 rows: 3.9e-3 relative), but slower: 24 layers chained (32 rows,
context 1088, page size 16, the merge and the chain's add included; H200, 2026-11-27) took 15.0-15.6 µs per layer
with 64-position blocks in 3 or 4 stages and 4 splits, against 13.1 for the Triton kernel. 128-position blocks
were not run on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .paged_attention_decode import _LOG2E, _M_INIT, choose_splits

F32 = jnp.float32
BLOCK = 64  # default key positions per step: N of Q K^T, K of P V
Q_ROWS = 64  # wgmma's M: the group's query heads, padded
_SWIZZLE = 128


def unsupported_reason(q, k_pages, block_table, window) -> str | None:
    """Why the kernel cannot take these inputs (None where it can). q: [B, H, D]."""
    if window is not None:
        return "sliding windows are not handled (the split's first block would start inside a page)"
    if q.dtype != jnp.bfloat16 or k_pages.dtype != jnp.bfloat16:
        return f"bf16 only (got q {q.dtype}, pages {k_pages.dtype})"
    _, page_size, groups, head_dim = k_pages.shape
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} must be 64 or 128 (128-byte swizzled rows)"
    if page_size not in (8, 16, 32, 64):
        return f"page_size {page_size} must divide the {BLOCK}-position block and be a multiple of 8"
    rep = q.shape[1] // groups
    if rep > Q_ROWS:
        return f"{rep} query heads per KV head exceed the wgmma's {Q_ROWS} rows"
    return None


def _tiles():
    return (plgpu.TilingTransform((8, _SWIZZLE // 2)), plgpu.SwizzleTransform(_SWIZZLE))


def partials(q, k_pages, v_pages, block_table, first_page, q_positions, *, splits: int, depth: int = 3,
             block: int = BLOCK):
    """q: [B, H, D]; pages [P, page_size, G, D]; block_table [B, W]; first_page [B]; q_positions [B]. Returns the
    splits' unnormalised outputs [B, S, H, D] and their running max and sum [B, S, H] (float32, exp2 domain).
    block: key positions per step (64 or 128)."""
    batch, heads, head_dim = q.shape
    _, page_size, groups, _ = k_pages.shape
    width = block_table.shape[1]
    rep = heads // groups
    rows8 = -(-rep // 8) * 8
    pages_per_block = block // page_size
    chunk_max = -(-(-(-width * page_size // splits)) // block) * block
    max_pages = chunk_max // page_size
    scale = head_dim**-0.5 * _LOG2E

    # the group's query heads padded to 8 rows; the table padded so that a split's slice never leaves it
    rows4 = -(-batch // 4) * 4  # TMA: whole 16 bytes of int32 per copy
    positions = jnp.pad(q_positions.astype(jnp.int32), (0, rows4 - batch))
    firsts = jnp.pad(first_page.astype(jnp.int32), (0, rows4 - batch))
    q_grouped = jnp.pad(q.reshape(batch, groups, rep, head_dim), ((0, 0), (0, 0), (0, rows8 - rep), (0, 0)))
    padded_width = -(-(width + max_pages) // 4) * 4  # TMA: a row stride of whole 16 bytes
    table = jnp.pad(block_table.astype(jnp.int32), ((0, 0), (0, padded_width - width)))

    def body(pos_gmem, first_gmem, table_gmem, q_gmem, k_gmem, v_gmem, o_gmem, m_gmem, l_gmem):
        g, s, b = lax.axis_index("g"), lax.axis_index("s"), lax.axis_index("b")

        def scoped(pos_smem, first_smem, ids_smem, q_smem, k_smem, v_smem, p_smem, o_smem, ml_smem, bars,
                   kv_ready):
            plgpu.copy_gmem_to_smem(pos_gmem, pos_smem, bars.at[0])
            plgpu.copy_gmem_to_smem(first_gmem, first_smem, bars.at[1])
            plgpu.copy_gmem_to_smem(q_gmem.at[b, g], q_smem.at[pl.ds(0, rows8)], bars.at[2])
            plgpu.barrier_wait(bars.at[0])
            plgpu.barrier_wait(bars.at[1])
            pos, first = pos_smem[b], first_smem[b]
            lo = first * page_size
            hi = jnp.clip(pos + 1, lo, (first + width) * page_size)
            chunk = (lax.div(lax.div(jnp.maximum(hi - lo, 0) + splits - 1, splits) + block - 1, block)) * block
            start = lo + s * chunk
            end = jnp.minimum(start + chunk, hi)
            iters = lax.div(jnp.maximum(end - start, 0) + block - 1, block)
            col0 = lax.div(start - lo, page_size)
            plgpu.copy_gmem_to_smem(table_gmem.at[b, pl.ds(col0, max_pages)], ids_smem, bars.at[3])
            plgpu.barrier_wait(bars.at[3])

            def page_id(i, j):
                return ids_smem[jnp.minimum(i * pages_per_block + j, max_pages - 1)]

            def any_page(i):
                """A non-empty page of block i (0 where every entry is empty)."""
                found = page_id(i, 0)
                for j in range(1, pages_per_block):
                    found = jnp.maximum(found, page_id(i, j))
                return found

            def issue(i):
                slot = lax.rem(i, depth)
                fallback = any_page(i)
                for j in range(pages_per_block):
                    pid = page_id(i, j)
                    pid = jnp.where(pid == 0, fallback, pid)
                    rows = pl.ds(j * page_size, page_size)
                    plgpu.copy_gmem_to_smem(k_gmem.at[pid, :, g, :], k_smem.at[slot, rows], kv_ready.at[slot])
                    plgpu.copy_gmem_to_smem(v_gmem.at[pid, :, g, :], v_smem.at[slot, rows], kv_ready.at[slot])

            for i in range(depth):
                @pl.when(i < iters)
                def _():
                    issue(i)

            plgpu.barrier_wait(bars.at[2])
            cols = plgpu.broadcasted_iota(jnp.int32, (Q_ROWS, block), 1, layout=plgpu.Layout.WGMMA)
            out_cols = plgpu.broadcasted_iota(jnp.int32, (Q_ROWS, head_dim), 1, layout=plgpu.Layout.WGMMA)

            def step(i, carry):
                acc, m, l = carry
                slot = lax.rem(i, depth)
                plgpu.barrier_wait(kv_ready.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                scores = pl.run_scoped(qk, plgpu.ACC((Q_ROWS, block), F32))
                valid = start + i * block + cols < end
                page_of = lax.div(cols, page_size)
                nonempty = None
                for j in range(pages_per_block):
                    here = (page_of == j) & (page_id(i, j) != 0)
                    nonempty = here if nonempty is None else nonempty | here
                scores = jnp.where(valid & nonempty, scores * scale, -jnp.inf)
                m_new = jnp.maximum(m, scores.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(scores - lax.broadcast_in_dim(m_new, scores.shape, [0]))
                l = l * alpha + p.sum(axis=1)

                p_smem[...] = p.astype(jnp.bfloat16)  # through SMEM, where the interpreter reads operands
                plgpu.commit_smem()

                def pv(acc_ref):  # this block's P V alone, added below: the running sum stays in registers
                    plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                    return acc_ref[...]

                block_out = pl.run_scoped(pv, plgpu.ACC((Q_ROWS, head_dim), F32))  # its V read: refillable
                # a block of empty entries only loaded the sink page (maybe NaN), each product times p = 0
                block_out = jnp.where(out_cols * 0 + any_page(i) != 0, block_out, 0.0)

                @pl.when(i + depth < iters)
                def _():
                    issue(i + depth)

                return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + block_out, m_new, l

            init = (
                plgpu.layout_cast(jnp.zeros((Q_ROWS, head_dim), F32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((Q_ROWS,), _M_INIT, F32), plgpu.Layout.WGMMA.reduce(1)),
                plgpu.layout_cast(jnp.zeros((Q_ROWS,), F32), plgpu.Layout.WGMMA.reduce(1)),
            )
            acc, m, l = lax.fori_loop(0, iters, step, init)
            o_smem[...] = acc
            ml_smem[0] = m
            ml_smem[1] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows8)], o_gmem.at[b, s, g])
            plgpu.copy_smem_to_gmem(ml_smem.at[0, pl.ds(0, rows8)], m_gmem.at[b, s, g])
            plgpu.copy_smem_to_gmem(ml_smem.at[1, pl.ds(0, rows8)], l_gmem.at[b, s, g])
            plgpu.wait_smem_to_gmem(0)

        bf16 = functools.partial(plgpu.SMEM, dtype=jnp.bfloat16, transforms=_tiles())
        pl.run_scoped(
            scoped,
            plgpu.SMEM((rows4,), jnp.int32), plgpu.SMEM((rows4,), jnp.int32), plgpu.SMEM((max_pages,), jnp.int32),
            bf16((Q_ROWS, head_dim)), bf16((depth, block, head_dim)), bf16((depth, block, head_dim)),
            bf16((Q_ROWS, block)),
            plgpu.SMEM((Q_ROWS, head_dim), F32), plgpu.SMEM((2, Q_ROWS), F32),
            plgpu.Barrier(num_barriers=4),
            plgpu.Barrier(num_arrivals=2 * pages_per_block, num_barriers=depth),
        )

    out_type = (jax.ShapeDtypeStruct((batch, splits, groups, rows8, head_dim), F32),
                jax.ShapeDtypeStruct((batch, splits, groups, rows8), F32),
                jax.ShapeDtypeStruct((batch, splits, groups, rows8), F32))
    acc, m, l = plgpu.kernel(body, out_type=out_type, grid=(groups, splits, batch), grid_names=("g", "s", "b"))(
        positions, firsts, table, q_grouped, k_pages, v_pages)
    return (acc[:, :, :, :rep].reshape(batch, splits, heads, head_dim),
            m[:, :, :, :rep].reshape(batch, splits, heads), l[:, :, :, :rep].reshape(batch, splits, heads))


def merge(acc, m, l, dtype):
    """The splits' partials merged (flash-decoding), as after the Triton kernel: rescaled to the common max; empty
    splits weigh nothing and a row with no visible key gets a zero output."""
    m_max = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp2(m - m_max)
    l_sum = jnp.sum(w * l, axis=1)
    o_sum = jnp.sum(w[..., None] * acc, axis=1)
    return jnp.where((l_sum > 0)[..., None], o_sum / jnp.where(l_sum > 0, l_sum, 1.0)[..., None], 0.0).astype(dtype)


def paged_attention_decode_tma(q, k_pages, v_pages, block_table, first_page, q_positions, window=None, *,
                               splits: int | None = None, depth: int = 3, block: int = BLOCK):
    """q: [B, 1, H, D] (the reference op's contract for T = 1). splits: K-splits per (row, KV head) (default: the
    Triton kernel's count for 128-token blocks); depth: ring stages of K/V blocks; block: key positions per step
    (64 or 128)."""
    q3 = q[:, 0]
    reason = unsupported_reason(q3, k_pages, block_table, window)
    if reason is not None:
        raise ValueError(f"paged_attention_decode_tma: {reason}")
    if block not in (64, 128) or block % k_pages.shape[1]:
        raise ValueError(f"paged_attention_decode_tma: block={block} must be 64 or 128 and a multiple of the "
                         f"page size {k_pages.shape[1]}")
    if splits is None:
        splits = choose_splits(q.shape[0], k_pages.shape[2], block_table.shape[1] * k_pages.shape[1], 128)
    acc, m, l = partials(q3, k_pages, v_pages, block_table, first_page, q_positions[:, 0], splits=splits,
                         depth=depth, block=block)
    return merge(acc, m, l, q.dtype)[:, None]
