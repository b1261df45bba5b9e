"""Chunked GDN/KDA prefill in Pallas (Triton backend) over a flat token buffer, with states read from and written
back to the state-slot pool in place.

The math is the WY form of ``apriel2_jax.ops.delta_rule`` (chunks of C = 64 tokens). Per chunk and head, with
cumulative log decay G (per token for GDN, per token and key channel for KDA):

    A   = strict_lower(beta_t * sum_c k_tc k_sc exp(G_tc - G_sc))      T = (I + A)^-1
    w   = T (beta * k * exp(G))        u = T (beta * v)                 (no state needed)
    v'  = u - w S0                     S_next = exp(G_last) S0 + (k * exp(G_last - G))^T v'
    o   = (q * exp(G)) S0 + (lower(sum_c q_tc k_sc exp(G_tc - G_sc))) v'

Three stages, following the split that fla and FlashQLA found faster than one fused kernel:

1. The intra-chunk stage, parallel over (chunk, head): A, its inverse, w, u, the masked q-k matrix, and the
   decayed q and k the other two stages need. GDN does it in one kernel, ``_gdn_intra_kernel``, whose inverse is
   the blockwise doubling ladder ``X <- X - X A_off X`` over block sizes 1, 2, ..., C/2 (MaxText PR #4348): it
   never forms powers of A, whose entries grow combinatorially, so it is stable where the Neumann series is not.
   KDA uses five kernels (below).
2. ``_state_kernel``, one program per (sequence, head, V-slab): the only sequential part. The fp32 state slab
   lives in registers across the sequence's chunks; it stores the state at each chunk start and v'.
3. ``_output_kernel``, parallel over (chunk, head, V-slab): o from the stored chunk-start states
   (``_state_output_kernel`` fuses 2 and 3 when there are many (sequence, head) pairs).

KDA's per-channel decay cannot be factored as (k e^G)(k e^-G)^T over a whole chunk: e^-G overflows once the decay
is strong (Apriel2's KDA gate has no lower bound). Its intra stage:

- ``_kda_prepare_kernel``: everything elementwise, once per (chunk, head): the chunk-local cumsum G, the q/k
  norm scales, G_last and the decayed operands q e^G, k e^(G_last - G), beta k e^G.
- ``_kda_products_kernel``, one program per 16-token row sub-block: the decayed products kk and qk. One
  product with the midpoint of the sub-block's decay as reference point where its decay spans at most
  ``DIAG_SPAN_LIMIT`` nats; a second call redoes the other sub-blocks in a form where no factor exceeds 1
  whatever the decay (one product for the columns of earlier sub-blocks, four for its own 16 x 16 block).
- ``_kda_inverse_kernel``: (I + beta kk)^-1 from 16x16 blocks (``_block_unit_lower_inverse``), at one warp.
- ``_kda_apply_kernel``, one program per 64-wide column slice: w and u, one product each.
Small kernels keep registers few and programs many: one kernel doing all of it held 255 registers (12.5%
occupancy) and was latency-bound (Nsight Compute, H100).

The output buffer comes from ``blank_output``, which zeroes only the rows outside every sequence.

Packing: sequences are cut into chunks that start at the sequence start; the intra stage reads each chunk's
C-token window of the flat buffer through the chunk table (rows outside the sequence load as zeros: zero k, beta
and g are identity updates) and writes the chunk layout [H, num_chunks, C, ...]. The chunk table bound
num_chunks = N // C + S holds for any lengths summing to at most N.

Precision: float32 inputs run every product in IEEE fp32 (parity with the reference op); bf16 inputs use bf16
operands with fp32 accumulation for the state products and GDN's q-k / k-k products (raw operands, the L2 norms
applied as row scales afterwards), and tf32 for the other intra-chunk ones, as fla does. KDA's decayed operands
(q e^G, k e^(G_last - G), beta k e^G) are stored in bf16, as the intra stage's outputs always were.
The reference (and CPU path) is ``apriel2_jax.ops.delta_rule.delta_rule_varlen_slots``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
CHUNK = 64
SUB = 16
# KDA sub-blocks whose decay spans at most this many nats (in every channel) take the one-product form of
# ``_kda_products_kernel``, with factors within exp(+-75): inside the fp32 and bf16 exponent range (exp(+-87)),
# with room for the raw q/k magnitudes they multiply. Stronger ones take its bounded form.
DIAG_SPAN_LIMIT = 150.0
# The dispatched configuration for many (sequence, head) pairs: see ``dispatch_config``.
FUSED_CONFIG = dict(block_v=(128, 128), num_warps=(4, 8, 4), num_stages=(1, 2, 2), fuse_output=True)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(q: jax.Array, v: jax.Array) -> bool:
    """The Triton backend needs power-of-two tiles: K and V must be powers of two, at least 16 (dot sizes)."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    return _is_power_of_two(key_dim) and _is_power_of_two(value_dim) and key_dim >= 16 and value_dim >= 16


def _dot(a, b, precision, trans_a=False, trans_b=False):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


# ----------------------------------------------------------------------------------------------------------------
# 1. Intra-chunk: A, (I + A)^-1, w, u, masked q-k, decayed q and k


def _unit_lower_inverse(a, precision):
    """(I + a)^-1 for a strictly lower square a, by blockwise doubling: X holds the inverses of the diagonal
    blocks of size b; merging two neighbours [[X1, 0], [A21, X2]] gives [[X1, 0], [-X2 A21 X1, X2]], i.e.
    X <- X - X A_off X (MaxText PR #4348). It never forms powers of a, whose entries grow combinatorially."""
    size = a.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, a.shape, 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, a.shape, 1)
    x = jnp.where(rows == cols, 1.0, 0.0) - jnp.where((rows // 2 == cols // 2) & (rows % 2 == 1) & (cols % 2 == 0), a, 0.0)
    b = 2
    while b < size:
        off = (rows // (2 * b) == cols // (2 * b)) & ((rows // b) % 2 == 1) & ((cols // b) % 2 == 0)
        x = x - _dot(_dot(x, jnp.where(off, a, 0.0), precision), x, precision)
        b *= 2
    return x


def _block_unit_lower_inverse(a, precision):
    """(I + a)^-1 for a strictly lower a given as SUB x SUB blocks ``a[i, j]`` (j <= i), returned the same way.
    The diagonal blocks by the ladder above (three steps at 16x16), then the blocks below them from
    X_ij = -X_ii sum_{j <= m < i} a_im X_mj: sixteen 16x16x16 products whose longest dependent chain is six,
    against the 64x64 ladder's ten dependent 64x64x64 ones (fla's solve_tril also merges 16x16 blocks). Only
    inverse blocks are multiplied, never powers of a. KDA B=1 T=8192 H=16 on an H100: 34 µs at 1 warp (49 at 2, 84
    at 4), against 114 for the 64x64 ladder, and 85 at 2 warps with the diagonal blocks by row-by-row forward
    substitution."""
    n = max(i for i, _ in a) + 1
    x = {(i, i): _unit_lower_inverse(a[i, i], precision) for i in range(n)}
    for i in range(1, n):
        for j in range(i - 1, -1, -1):
            acc = _dot(a[i, j], x[j, j], precision)
            for m in range(j + 1, i):
                acc += _dot(a[i, m], x[m, j], precision)
            x[i, j] = -_dot(x[i, i], acc, precision)
    return x


def _window(start_ref, lo_ref, hi_ref, chunk, size):
    """The chunk's window of the flat buffer, and a loader for it. Rows outside [lo, hi) belong to another sequence
    (or none) and load as zeros: zero k, beta and g make them identity updates, wherever they sit in the chunk.
    Returns (t, ok, start, load): token offsets in the window, their validity, the window's first row, and
    ``load(ref, head, c0, width, index=None)``, the window's rows (or rows ``index``), columns [c0, c0 + width)."""
    start, lo, hi = start_ref[chunk], lo_ref[chunk], hi_ref[chunk]
    t = jax.lax.broadcasted_iota(jnp.int32, (size,), 0)

    def load(ref, h, c0, width, index=None):
        index = t if index is None else index
        shape = (index.shape[0], width)
        c2 = c0 + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
        ok = (index >= lo) & (index < hi)
        return pltriton.load(ref.at[jnp.broadcast_to((start + index)[:, None], shape), h, c2],
                             mask=jnp.broadcast_to(ok[:, None], shape), other=0)

    return t, (t >= lo) & (t < hi), start, load


def _f32(x):
    return x.astype(F32)


def _norm_scale(load, ref, head, key_dim, index=None):
    """The L2-norm row scale 1 / |x| of q or k rows, summed over column slices (no whole [C, K] tile held)."""
    bk = min(64, key_dim)
    sq = 0.0
    for c0 in range(0, key_dim, bk):
        sq += jnp.sum(jnp.square(_f32(load(ref, head, c0, bk, index))), axis=1)
    return jax.lax.rsqrt(sq + 1e-6)


def _kda_prepare_kernel(start_ref, lo_ref, hi_ref, q_ref, k_ref, g_ref, beta_ref,
                        G_ref, scales_ref, qg_ref, kd_ref, kb_ref, glast_ref, *, rep):
    """Per (chunk, head), everything of KDA's intra stage that is elementwise in the chunk layout: the
    chunk-local cumulative log decay G [C, K] and the q/k L2-norm row scales [2, C] (q's with K^-1/2), which the
    products kernel reads; the chunk's total decay G_last [K]; and the decayed operands q e^G, k e^(G_last - G)
    (the state and output kernels') and beta k e^G (w's, ``_kda_apply_kernel``). Computed once here rather than
    by the products kernel's four sub-block programs or the apply kernel's column slices: a scan down the rows of
    a tile is costly in Triton, and the apply kernel computing the decayed operands itself held 255 registers
    (12.5% occupancy, Nsight Compute). KDA B=1 T=8192 H=16 on an H100: this kernel 76 -> 135 µs with the decayed
    operands, the apply kernel 207 -> 112. Rows outside the sequence load g = 0, so G stays flat there; their k
    and beta load as zero."""
    chunk, head = pl.program_id(0), pl.program_id(1)
    size, key_dim = G_ref.shape[2], G_ref.shape[3]
    key_head = head // rep
    bs = min(64, key_dim)
    t, ok, start, load = _window(start_ref, lo_ref, hi_ref, chunk, size)
    q_scale = _norm_scale(load, q_ref, key_head, key_dim) * key_dim**-0.5
    k_scale = _norm_scale(load, k_ref, key_head, key_dim)
    scales_ref[head, chunk, 0, :] = q_scale
    scales_ref[head, chunk, 1, :] = k_scale
    beta = _f32(pltriton.load(beta_ref.at[start + t, head], mask=ok, other=0))
    out = qg_ref.dtype
    for c0 in range(0, key_dim, bs):
        cs = pl.ds(c0, bs)
        G = jnp.cumsum(_f32(load(g_ref, head, c0, bs)), axis=0)
        G_ref[head, chunk, :, cs] = G
        g_last = jnp.sum(jnp.where((t == size - 1)[:, None], G, 0.0), axis=0)
        glast_ref[head, chunk, cs] = g_last
        decay = jnp.exp(G)
        k = _f32(load(k_ref, key_head, c0, bs)) * k_scale[:, None]
        qg_ref[head, chunk, :, cs] = (_f32(load(q_ref, key_head, c0, bs)) * q_scale[:, None] * decay).astype(out)
        kd_ref[head, chunk, :, cs] = (k * jnp.exp(g_last[None, :] - G)).astype(out)
        kb_ref[head, chunk, :, cs] = (k * decay * beta[:, None]).astype(out)


def _kda_products_kernel(start_ref, lo_ref, hi_ref, q_ref, k_ref, G_ref, scales_ref, *refs, rep, precision,
                         span_limit, form):
    """KDA's decayed products for one 16-row sub-block r of a chunk, over (r, chunk, head):
    kk[t, s] = k_t . k_s exp(G_t - G_s) (t > s) and qk[t, s] = q_t . k_s exp(G_t - G_s) (t >= s), q/k
    L2-normalized, for the sub-block's rows t. The per-channel decay cannot be factored over a whole chunk
    (exp(-G) overflows under strong decay; Apriel2's KDA gate has no lower bound), so each sub-block takes one of
    two forms, by its span (the largest decay its 16 tokens cover in any channel):

    - span <= ``span_limit``: one product per column slice, with the midpoint of the sub-block's decay as
      reference point: columns of earlier sub-blocks get factors <= 1, its own columns factors within
      exp(+-span / 2). Factors must stay inside the fp32/bf16 exponent range (about exp(+-87)) for the products
      that count (t >= s) to be exact; masked pairs may overflow, and are replaced, not multiplied.
    - stronger decay: no factor above 1 anywhere. Columns of earlier sub-blocks take the decay just before the
      sub-block as reference point; the sub-block's own 16 x 16 block takes four more products, one per bit of
      the offset within it (below). About four times the work of the first form.

    ``form`` "midpoint": every sub-block's span, written to the flags, and the first form where it applies;
    "bounded": the second form for the flagged sub-blocks (outputs aliased onto the first call's). Two kernels,
    as one holding both forms needed the registers of the larger for both (mild decay, K = 128, H200: 316 µs in
    one kernel, 187 + 25 µs in these two).

    A program per sub-block keeps its row tiles at 16 rows, loaded straight from the buffer, and its registers
    few: one kernel for the whole chunk held 255 registers (12.5% occupancy) and multiplied 64-row tiles of which
    only 16 rows were non-zero (Nsight Compute, H100). The sub-blocks of a chunk run side by side in the grid (a
    chunk's G and k are read from L2 by its four programs, not from HBM), and the first two sub-blocks multiply
    only the first half of the columns."""
    if form == "midpoint":
        kk_ref, qk_ref, flag_ref = refs
    else:
        flag_ref, _, _, kk_ref, qk_ref = refs
    r, chunk, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)  # sub-blocks of a chunk run together
    key_head = head // rep
    size, key_dim = kk_ref.shape[2], q_ref.shape[-1]
    bs = min(64, key_dim)  # 32-wide slices measured no faster (370 vs 366 µs, H100)
    _, _, _, load = _window(start_ref, lo_ref, hi_ref, chunk, size)
    sub = jax.lax.broadcasted_iota(jnp.int32, (SUB,), 0)
    rows = r * SUB + sub
    block_rows = pl.ds(r * SUB, SUB)
    k_scale_rows = scales_ref[head, chunk, 1, block_rows]
    q_scale_rows = scales_ref[head, chunk, 0, block_rows]

    def base_row(cs):  # G just before the sub-block (0 for the first), [1, bs]
        return jnp.where(r > 0, G_ref[head, chunk, pl.ds(jnp.maximum(r * SUB - 1, 0), 1), cs], 0.0)

    if form == "midpoint":
        span = 0.0
        for c0 in range(0, key_dim, bs):
            cs = pl.ds(c0, bs)
            span = jnp.maximum(span, jnp.max(base_row(cs) - G_ref[head, chunk, pl.ds(r * SUB + SUB - 1, 1), cs]))
        mild = span <= span_limit
        flag_ref[head, chunk, r] = (~mild).astype(jnp.int32)
    else:
        mild = flag_ref[head, chunk, r] == 0

    def store(kk, qk, width, t, mask=None):
        """Scaled and masked products of columns [0, width) (``mask``: only those columns)."""
        k_scale = scales_ref[head, chunk, 1, pl.ds(0, width)]
        below = rows[:, None] - t[None, :]
        kk = jnp.where(below > 0, kk * (k_scale_rows[:, None] * k_scale[None, :]), 0.0)
        qk = jnp.where(below >= 0, qk * (q_scale_rows[:, None] * k_scale[None, :]), 0.0).astype(qk_ref.dtype)
        if mask is None:
            kk_ref[head, chunk, block_rows, pl.ds(0, width)] = kk
            qk_ref[head, chunk, block_rows, pl.ds(0, width)] = qk
        else:
            target = (jnp.broadcast_to(rows[:, None], (SUB, width)), jnp.broadcast_to(t[None, :], (SUB, width)))
            pltriton.store(kk_ref.at[head, chunk, target[0], target[1]], kk, mask=mask)
            pltriton.store(qk_ref.at[head, chunk, target[0], target[1]], qk, mask=mask)
        # kk's columns from ``width`` on stay unwritten: its only reader, the inverse kernel, reads the 16x16
        # blocks on and below the diagonal. qk's readers take whole tiles.
        if width < size:
            qk_ref[head, chunk, block_rows, pl.ds(width, size - width)] = jnp.zeros((SUB, size - width), qk_ref.dtype)

    def midpoint_form(width):  # over the columns [0, width): every column that the sub-block's rows see
        t = jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
        reach = (t < (r + 1) * SUB)[:, None]
        kk = jnp.zeros((SUB, width), F32)
        qk = jnp.zeros((SUB, width), F32)
        for c0 in range(0, key_dim, bs):
            cs = pl.ds(c0, bs)
            G = G_ref[head, chunk, pl.ds(0, width), cs]
            mid = 0.5 * (base_row(cs) + G_ref[head, chunk, pl.ds(r * SUB + SUB - 1, 1), cs])  # [1, bs]
            row_decay = jnp.exp(G_ref[head, chunk, block_rows, cs] - mid)
            col = _f32(load(k_ref, key_head, c0, bs, t)) * jnp.exp(jnp.where(reach, mid - G, -jnp.inf))
            kk += _dot(_f32(load(k_ref, key_head, c0, bs, rows)) * row_decay, col, precision, trans_b=True)
            qk += _dot(_f32(load(q_ref, key_head, c0, bs, rows)) * row_decay, col, precision, trans_b=True)
        store(kk, qk, width, t)

    def bounded_form(width):
        # The own 16 x 16 block. A pair t > s is split at the highest bit L where their offsets i differ: s lies
        # in the left half of the aligned block of size 2^(L+1) that holds both, t in its right half, and the
        # left half's last token p is a reference point with exp(G_t - G_p) <= 1 and exp(G_p - G_s) <= 1. p
        # depends on the level and on either offset alone, so each level is one product of row and column
        # factors (rows with bit L set, columns without it), masked to pairs in the same block. t = s is a
        # plain product (exp(0) = 1).
        own_kk = jnp.zeros((SUB, SUB), F32)
        own_qk = jnp.zeros((SUB, SUB), F32)
        own_diag = jnp.zeros((SUB, SUB), F32)
        t = jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
        earlier = (t < r * SUB)[:, None]
        kk = jnp.zeros((SUB, width), F32)
        qk = jnp.zeros((SUB, width), F32)
        for c0 in range(0, key_dim, bs):
            cs = pl.ds(c0, bs)
            cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (SUB, bs), 1)
            G_rows = G_ref[head, chunk, block_rows, cs]
            k_rows = _f32(load(k_ref, key_head, c0, bs, rows))
            q_rows = _f32(load(q_ref, key_head, c0, bs, rows))
            own_diag += _dot(q_rows, k_rows, precision, trans_b=True)
            for level in range(SUB.bit_length() - 1):
                p = r * SUB + ((sub >> (level + 1)) << (level + 1)) + (1 << level) - 1
                G_p = pltriton.load(G_ref.at[head, chunk, jnp.broadcast_to(p[:, None], (SUB, bs)), cols])
                right = (((sub >> level) & 1) == 1)[:, None]
                row_decay = jnp.where(right, jnp.exp(jnp.minimum(G_rows - G_p, 0.0)), 0.0)
                col = jnp.where(right, 0.0, k_rows * jnp.exp(jnp.minimum(G_p - G_rows, 0.0)))
                same = (sub[:, None] >> (level + 1)) == (sub[None, :] >> (level + 1))
                own_kk += jnp.where(same, _dot(k_rows * row_decay, col, precision, trans_b=True), 0.0)
                own_qk += jnp.where(same, _dot(q_rows * row_decay, col, precision, trans_b=True), 0.0)
            # Columns of earlier sub-blocks: reference point just before the sub-block.
            base = base_row(cs)
            col = _f32(load(k_ref, key_head, c0, bs, t)) * jnp.exp(
                jnp.where(earlier, base - G_ref[head, chunk, pl.ds(0, width), cs], -jnp.inf))
            row_decay = jnp.exp(G_rows - base)
            kk += _dot(k_rows * row_decay, col, precision, trans_b=True)
            qk += _dot(q_rows * row_decay, col, precision, trans_b=True)
        own_qk = jnp.where(sub[:, None] == sub[None, :], own_diag, own_qk)
        kk_ref[head, chunk, block_rows, block_rows] = jnp.where(
            sub[:, None] > sub[None, :], own_kk * (k_scale_rows[:, None] * k_scale_rows[None, :]), 0.0)
        qk_ref[head, chunk, block_rows, block_rows] = jnp.where(
            sub[:, None] >= sub[None, :], own_qk * (q_scale_rows[:, None] * k_scale_rows[None, :]), 0.0
        ).astype(qk_ref.dtype)
        # Every column but the own ones (a store covering those too would race with the one above).
        store(kk, qk, width, t, mask=jnp.broadcast_to(((t < r * SUB) | (t >= (r + 1) * SUB))[None, :], (SUB, width)))

    # The first half of the sub-blocks sees only the first half of the columns: half the work for them.
    half = size // 2
    for width, sees in ((half, r < half // SUB), (size, r >= half // SUB)):
        if form == "midpoint":
            pl.when(sees & mild)(functools.partial(midpoint_form, width))
        else:
            pl.when(sees & ~mild)(functools.partial(bounded_form, width))


def _kda_inverse_kernel(start_ref, lo_ref, hi_ref, beta_ref, kk_ref, x_ref, *, precision):
    """KDA's (I + beta kk)^-1 over (chunk, head), from the decayed k-k products in memory, read and written as
    16x16 blocks (``_block_unit_lower_inverse``), the blocks above the diagonal written as zeros."""
    chunk, head = pl.program_id(0), pl.program_id(1)
    start, lo, hi = start_ref[chunk], lo_ref[chunk], hi_ref[chunk]
    n = CHUNK // SUB
    a = {}
    for i in range(n):
        t = i * SUB + jax.lax.broadcasted_iota(jnp.int32, (SUB,), 0)
        beta = _f32(pltriton.load(beta_ref.at[start + t, head], mask=(t >= lo) & (t < hi), other=0))
        for j in range(i + 1):
            a[i, j] = kk_ref[head, chunk, pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] * beta[:, None]
    x = _block_unit_lower_inverse(a, precision)
    for i in range(n):
        for j in range(n):
            block = x[i, j] if j <= i else jnp.zeros((SUB, SUB), F32)
            x_ref[head, chunk, pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = block


def _kda_apply_kernel(start_ref, lo_ref, hi_ref, v_ref, beta_ref, kb_ref, x_ref, w_ref, u_ref, *, precision):
    """KDA's w = X (beta k e^G) and u = X (beta v), over (64-wide column slice, chunk, head): slices below
    K / 64 are w's (beta k e^G from ``_kda_prepare_kernel``), the rest u's. One product per program keeps its
    registers few and its programs many; the slices fastest in the grid read a chunk's X from L2 (112 -> 96 µs
    at KDA B=1 T=8192 H=16, H100)."""
    part, chunk, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)  # a chunk's slices run together
    key_dim, value_dim = kb_ref.shape[-1], v_ref.shape[-1]
    bk, bv = min(64, key_dim), min(64, value_dim)
    key_parts = key_dim // bk
    t, ok, start, load = _window(start_ref, lo_ref, hi_ref, chunk, CHUNK)
    x = x_ref[head, chunk, :, :]

    @pl.when(part < key_parts)
    def _():
        cs = pl.ds(part * bk, bk)
        w_ref[head, chunk, :, cs] = _dot(x, _f32(kb_ref[head, chunk, :, cs]), precision).astype(w_ref.dtype)

    @pl.when(part >= key_parts)
    def _():
        c0 = (part - key_parts) * bv
        beta = _f32(pltriton.load(beta_ref.at[start + t, head], mask=ok, other=0))
        v = _f32(load(v_ref, head, c0, bv)) * beta[:, None]
        u_ref[head, chunk, :, pl.ds(c0, bv)] = _dot(x, v, precision).astype(u_ref.dtype)


def _gdn_intra_kernel(start_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                      w_ref, u_ref, qk_ref, qg_ref, kd_ref, glast_ref, *, rep, precision):
    """GDN's intra stage over (chunk, head): the masked q-k matrix, (I + beta A)^-1, w, u, the decayed q and k
    and the chunk's total decay, in one kernel. Measured slower on an H100 (B=1 T=8192 H=16): split in two, an
    inverse and a column-slice kernel (307 against 203 µs; the second kernel re-reads the operands), and in
    16-row blocks throughout like KDA's inverse (291 against 206 µs at 4 warps, 335 at 2).

    Register budget drives the layout: q, k and v are read in column slices of at most 64 (each slice several
    times, from cache) rather than held whole, and q/k are normalized by row scales applied to the products;
    whole [64, 128] fp32 tiles spilled to local memory at 255 registers (Nsight Compute, H100)."""
    chunk, head = pl.program_id(0), pl.program_id(1)
    key_head = head // rep
    size = CHUNK
    key_dim, value_dim = q_ref.shape[-1], v_ref.shape[-1]
    bk, bv = min(64, key_dim), min(64, value_dim)
    t, ok, start, load = _window(start_ref, lo_ref, hi_ref, chunk, size)
    cols = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
    rows = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    q_scale = _norm_scale(load, q_ref, key_head, key_dim) * key_dim**-0.5
    k_scale = _norm_scale(load, k_ref, key_head, key_dim)
    beta = _f32(pltriton.load(beta_ref.at[start + t, head], mask=ok, other=0))
    G = jnp.cumsum(_f32(pltriton.load(g_ref.at[start + t, head], mask=ok, other=0)))
    g_last = jnp.sum(jnp.where(t == size - 1, G, 0.0))
    kk = jnp.zeros((size, size), F32)
    qk = jnp.zeros((size, size), F32)
    for c0 in range(0, key_dim, bk):  # raw operands (bf16 products exact), normalized by the row scales
        k = load(k_ref, key_head, c0, bk)
        q = load(q_ref, key_head, c0, bk)
        kk += _dot(k, k, precision, trans_b=True)
        qk += _dot(q, k, precision, trans_b=True)
    pair = jnp.exp(jnp.where(rows >= cols, G[:, None] - G[None, :], -jnp.inf)) * k_scale[None, :]
    kk = jnp.where(rows > cols, kk * pair * k_scale[:, None], 0.0)
    qk_ref[head, chunk, :, :] = (qk * pair * q_scale[:, None]).astype(qk_ref.dtype)
    glast_ref[head, chunk] = g_last
    x = _unit_lower_inverse(kk * beta[:, None], precision)
    out = w_ref.dtype
    decay, to_end = jnp.exp(G)[:, None], jnp.exp(g_last - G)[:, None]
    for c0 in range(0, key_dim, bk):
        cs = pl.ds(c0, bk)
        k = _f32(load(k_ref, key_head, c0, bk)) * k_scale[:, None]
        w_ref[head, chunk, :, cs] = _dot(x, k * decay * beta[:, None], precision).astype(out)
        qg_ref[head, chunk, :, cs] = (_f32(load(q_ref, key_head, c0, bk)) * q_scale[:, None] * decay).astype(out)
        kd_ref[head, chunk, :, cs] = (k * to_end).astype(out)
    for c0 in range(0, value_dim, bv):
        v = _f32(load(v_ref, head, c0, bv))
        u_ref[head, chunk, :, pl.ds(c0, bv)] = _dot(x, v * beta[:, None], precision).astype(out)


# ----------------------------------------------------------------------------------------------------------------
# 2. The recurrence over chunks


def _state_kernel(
    first_ref, count_ref, slots_ref, fresh_ref, w_ref, u_ref, kd_ref, glast_ref, pool_in_ref,
    h_ref, vnew_ref, pool_ref, *, bv, kda, precision,
):
    del pool_in_ref  # aliased with pool_ref: the pool is updated in place
    seq, head, slab = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(slab * bv, bv)
    slot = slots_ref[seq]
    state = pool_ref[slot, head, :, cols]  # [K, BV] fp32
    state = jnp.where(fresh_ref[seq] != 0, jnp.zeros_like(state), state)
    first = first_ref[seq]
    mm = w_ref.dtype

    def chunk_step(i, state):
        chunk = first + i
        h_ref[head, chunk, :, cols] = state.astype(h_ref.dtype)
        w = w_ref[head, chunk, :, :]
        v_new = u_ref[head, chunk, :, cols].astype(F32) - _dot(w, state.astype(mm), precision)
        vnew_ref[head, chunk, :, cols] = v_new.astype(vnew_ref.dtype)
        if kda:
            end_decay = jnp.exp(glast_ref[head, chunk, :])[:, None]  # [K, 1]
        else:
            end_decay = jnp.exp(glast_ref[head, chunk])
        return end_decay * state + _dot(kd_ref[head, chunk, :, :], v_new.astype(mm), precision, trans_a=True)

    state = jax.lax.fori_loop(0, count_ref[seq], chunk_step, state)
    pool_ref[slot, head, :, cols] = state


def _state_output_kernel(
    first_ref, count_ref, slots_ref, fresh_ref, start_ref, lo_ref, hi_ref, w_ref, u_ref, kd_ref, glast_ref, qg_ref,
    qk_ref, pool_in_ref, o_in_ref, pool_ref, o_ref, *, bv, kda, precision,
):
    """Kernels 2 and 3 in one: the output of each chunk straight from the register state, so neither the
    chunk-start states nor v' go through memory. Pays off when there are enough (sequence, head, slab) programs
    to fill the GPU; with few long sequences the separate, chunk-parallel output kernel is shorter."""
    del pool_in_ref, o_in_ref  # aliased with pool_ref / o_ref
    seq, head, slab = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(slab * bv, bv)
    slot = slots_ref[seq]
    state = pool_ref[slot, head, :, cols]
    state = jnp.where(fresh_ref[seq] != 0, jnp.zeros_like(state), state)
    first = first_ref[seq]
    mm = w_ref.dtype
    size = u_ref.shape[2]
    t = jax.lax.broadcasted_iota(jnp.int32, (size, bv), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (size, bv), 1) + slab * bv

    def chunk_step(i, state):
        chunk = first + i
        h = state.astype(mm)
        v_new = u_ref[head, chunk, :, cols].astype(F32) - _dot(w_ref[head, chunk, :, :], h, precision)
        out = _dot(qg_ref[head, chunk, :, :], h, precision)
        out += _dot(qk_ref[head, chunk, :, :], v_new.astype(mm), precision)
        ok = (t >= lo_ref[chunk]) & (t < hi_ref[chunk])
        pltriton.store(o_ref.at[start_ref[chunk] + t, head, c], out.astype(o_ref.dtype), mask=ok)
        if kda:
            end_decay = jnp.exp(glast_ref[head, chunk, :])[:, None]
        else:
            end_decay = jnp.exp(glast_ref[head, chunk])
        return end_decay * state + _dot(kd_ref[head, chunk, :, :], v_new.astype(mm), precision, trans_a=True)

    state = jax.lax.fori_loop(0, count_ref[seq], chunk_step, state)
    pool_ref[slot, head, :, cols] = state


# ----------------------------------------------------------------------------------------------------------------
# 3. Output


def _output_kernel(start_ref, lo_ref, hi_ref, qg_ref, h_ref, qk_ref, vnew_ref, o_in_ref, o_ref, *, bv, precision):
    del o_in_ref  # aliased with o_ref (``blank_output``: tokens outside every sequence are zero)
    chunk, head, slab = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(slab * bv, bv)
    mm = qg_ref.dtype
    out = _dot(qg_ref[head, chunk, :, :], h_ref[head, chunk, :, cols].astype(mm), precision)
    out += _dot(qk_ref[head, chunk, :, :], vnew_ref[head, chunk, :, cols].astype(mm), precision)
    size = out.shape[0]
    t = jax.lax.broadcasted_iota(jnp.int32, (size, bv), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (size, bv), 1) + slab * bv
    ok = (t >= lo_ref[chunk]) & (t < hi_ref[chunk])
    pltriton.store(o_ref.at[start_ref[chunk] + t, head, c], out.astype(o_ref.dtype), mask=ok)


# ----------------------------------------------------------------------------------------------------------------
# Packing and the entry point


def chunk_table(starts: jax.Array, lengths: jax.Array, num_tokens: int, num_chunks: int):
    """Chunks of every sequence, in sequence order. Per chunk: the first token of its C-token window of the flat
    buffer (clamped so the window stays inside it) and the valid rows [lo, hi) of that window; per sequence:
    its first chunk and chunk count. Unused chunks have lo = hi = 0."""
    count = (lengths + CHUNK - 1) // CHUNK
    ends = jnp.cumsum(count)
    first = ends - count
    i = jnp.arange(num_chunks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, i, side="right"), starts.shape[0] - 1)
    j = i - first[seq]
    chunk_len = jnp.where(i < ends[-1], jnp.clip(lengths[seq] - j * CHUNK, 0, CHUNK), 0)
    begin = starts[seq] + j * CHUNK
    window = jnp.clip(begin, 0, num_tokens - CHUNK)
    lo = jnp.where(chunk_len > 0, begin - window, 0)
    as_i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    return tuple(map(as_i32, (window, lo, lo + chunk_len, first, count)))


def _params(dtype, num_warps, num_stages):
    exact = dtype == F32
    precision = jax.lax.Precision.HIGHEST if exact else jax.lax.Precision.DEFAULT
    return precision, pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def intra(table, q, k, v, g, beta, num_chunks, *, span_limit=DIAG_SPAN_LIMIT, num_warps=4, num_stages=1,
          products_warps=4, inverse_warps=1, interpret=False):
    """The intra-chunk stage, reading the flat buffers: w, u, masked q-k, decayed q and k in the chunk layout
    [H, num_chunks, C, .], and the chunk's total log decay. GDN: one kernel over (chunk, head). KDA: the prepare
    kernel, the decayed products kk and qk (``_kda_products_kernel`` over sub-blocks), the inverse, then w and u
    per column slice (``_kda_apply_kernel``). ``num_warps`` and ``num_stages`` apply to the GDN kernel and KDA's
    prepare and apply kernels."""
    heads, value_dim = v.shape[1:]
    key_heads, key_dim = q.shape[1:]
    rep = heads // key_heads
    mm = F32 if v.dtype == F32 else jnp.bfloat16
    precision, params = _params(v.dtype, num_warps, num_stages)
    sds = jax.ShapeDtypeStruct
    per_key = sds((heads, num_chunks, CHUNK, key_dim), mm)
    w_shape, u_shape = per_key, sds((heads, num_chunks, CHUNK, value_dim), mm)
    square = lambda dtype: sds((heads, num_chunks, CHUNK, CHUNK), dtype)  # noqa: E731
    call = functools.partial(pl.pallas_call, interpret=interpret)
    g = g.astype(F32)
    if g.ndim == 2:
        w, u, qk, qg, kd, glast = call(
            functools.partial(_gdn_intra_kernel, rep=rep, precision=precision), grid=(num_chunks, heads),
            out_shape=(w_shape, u_shape, square(mm), per_key, per_key, sds((heads, num_chunks), F32)),
            compiler_params=params, name="delta_rule_intra_gdn")(*table[:3], q, k, v, g, beta)
        return w, u, qk, qg, kd, glast
    G, scales, qg, kd, kb, glast = call(
        functools.partial(_kda_prepare_kernel, rep=rep), grid=(num_chunks, heads),
        out_shape=(sds((heads, num_chunks, CHUNK, key_dim), F32), sds((heads, num_chunks, 2, CHUNK), F32),
                   per_key, per_key, per_key, sds((heads, num_chunks, key_dim), F32)),
        compiler_params=params, name="delta_rule_kda_prepare")(*table[:3], q, k, g, beta)
    products = functools.partial(_kda_products_kernel, rep=rep, precision=precision, span_limit=span_limit)
    products_params = pltriton.CompilerParams(num_warps=products_warps, num_stages=1)
    kk, qk, flag = call(
        functools.partial(products, form="midpoint"), grid=(CHUNK // SUB, num_chunks, heads),
        out_shape=(square(F32), square(mm), sds((heads, num_chunks, CHUNK // SUB), jnp.int32)),
        compiler_params=products_params, name="delta_rule_kda_products")(*table[:3], q, k, G, scales)
    kk, qk = call(
        functools.partial(products, form="bounded"), grid=(CHUNK // SUB, num_chunks, heads),
        out_shape=(square(F32), square(mm)), input_output_aliases={8: 0, 9: 1}, compiler_params=products_params,
        name="delta_rule_kda_products_bounded")(*table[:3], q, k, G, scales, flag, kk, qk)
    x = call(
        functools.partial(_kda_inverse_kernel, precision=precision),
        grid=(num_chunks, heads), out_shape=square(F32),
        compiler_params=pltriton.CompilerParams(num_warps=inverse_warps, num_stages=1),
        name="delta_rule_kda_inverse")(*table[:3], beta, kk)
    parts = key_dim // min(64, key_dim) + value_dim // min(64, value_dim)
    w, u = call(
        functools.partial(_kda_apply_kernel, precision=precision), grid=(parts, num_chunks, heads),
        out_shape=(w_shape, u_shape), compiler_params=params,
        name="delta_rule_kda_apply")(*table[:3], v, beta, kb, x)
    return w, u, qk, qg, kd, glast


def state(first, count, slots, fresh, w, u, kd, glast, state_pool, *, block_v=16, num_warps=4, num_stages=4,
          interpret=False):
    """Kernel 2 over (sequence, head, V-slab): chunk-start states h, v', and the pool updated in place."""
    heads, num_chunks, size, value_dim = u.shape
    key_dim = w.shape[-1]
    block_v = min(block_v, value_dim)
    precision, params = _params(u.dtype, num_warps, num_stages)
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(_state_kernel, bv=block_v, kda=glast.ndim == 3, precision=precision),
        name="delta_rule_state",
        grid=(first.shape[0], heads, value_dim // block_v),
        out_shape=(
            sds((heads, num_chunks, key_dim, value_dim), u.dtype),
            sds((heads, num_chunks, size, value_dim), u.dtype),
            sds(state_pool.shape, F32),
        ),
        input_output_aliases={8: 2},
        compiler_params=params,
        interpret=interpret,
    )(first, count, slots.astype(jnp.int32), fresh.astype(jnp.int32), w, u, kd, glast, state_pool)


def state_output(table, slots, fresh, w, u, kd, glast, qg, qk, state_pool, o_flat, *, block_v=32, num_warps=4,
                 num_stages=2, interpret=False):
    """Kernels 2 + 3 fused over (sequence, head, V-slab): o written into ``o_flat`` (aliased) and the pool."""
    heads, num_chunks, size, value_dim = u.shape
    block_v = min(block_v, value_dim)
    precision, params = _params(u.dtype, num_warps, num_stages)
    first, count = table[3], table[4]
    return pl.pallas_call(
        functools.partial(_state_output_kernel, bv=block_v, kda=glast.ndim == 3, precision=precision),
        name="delta_rule_state_output",
        grid=(first.shape[0], heads, value_dim // block_v),
        out_shape=(jax.ShapeDtypeStruct(state_pool.shape, F32), jax.ShapeDtypeStruct(o_flat.shape, o_flat.dtype)),
        input_output_aliases={13: 0, 14: 1},
        compiler_params=params,
        interpret=interpret,
    )(first, count, slots.astype(jnp.int32), fresh.astype(jnp.int32), *table[:3], w, u, kd, glast, qg, qk,
      state_pool, o_flat)[::-1]


def output(table, qg, h, qk, v_new, o_flat, *, block_v=128, num_warps=4, num_stages=2, interpret=False):
    """Kernel 3 over (chunk, head, V-slab): o written into the flat buffer ``o_flat`` (aliased) by valid row."""
    heads, num_chunks, size, value_dim = v_new.shape
    block_v = min(block_v, value_dim)
    precision, params = _params(v_new.dtype, num_warps, num_stages)
    return pl.pallas_call(
        functools.partial(_output_kernel, bv=block_v, precision=precision),
        name="delta_rule_output",
        grid=(num_chunks, heads, value_dim // block_v),
        out_shape=jax.ShapeDtypeStruct(o_flat.shape, o_flat.dtype),
        input_output_aliases={7: 0},
        compiler_params=params,
        interpret=interpret,
    )(*table[:3], qg, h, qk, v_new, o_flat)


def _blank_kernel(covered_ref, o_ref):
    """Zeros in the rows of one 64-token block, one head, that no sequence covers; the other rows are left as
    allocated, for the output kernels to write."""
    block, head = pl.program_id(0), pl.program_id(1)
    num_tokens, value_dim = o_ref.shape[0], o_ref.shape[2]
    t = block * CHUNK + jax.lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    shape = (CHUNK, value_dim)
    rows = jnp.broadcast_to(t[:, None], shape)
    cols = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    inside = t < num_tokens
    uncovered = inside & (pltriton.load(covered_ref.at[jnp.where(inside, t, 0)], mask=inside, other=1) == 0)
    pltriton.store(o_ref.at[rows, head, cols], jnp.zeros(shape, o_ref.dtype),
                   mask=jnp.broadcast_to(uncovered[:, None], shape))


def blank_output(starts, lengths, shape, dtype, *, interpret=False):
    """The output buffer before the output kernels write it: zeros only in the token rows outside every sequence
    (padding), the rest left unwritten, instead of a zero fill of the whole buffer (134 MB at B=8 T=2048 H=32; end to
    end there 1.353 -> 1.270 ms on an H100, across two machine instances; fla allocates its output
    uninitialized)."""
    num_tokens = shape[0]
    edges = jnp.zeros((num_tokens + 1,), jnp.int32).at[starts].add(1).at[starts + lengths].add(-1)
    covered = (jnp.cumsum(edges)[:num_tokens] > 0).astype(jnp.int32)
    return pl.pallas_call(
        _blank_kernel, grid=(pl.cdiv(num_tokens, CHUNK), shape[1]), out_shape=jax.ShapeDtypeStruct(shape, dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="delta_rule_blank_output")(covered)


@functools.partial(
    jax.jit,
    static_argnames=("max_len", "block_v", "num_warps", "num_stages", "fuse_output", "diag_span_limit",
                     "products_warps", "interpret"),
    donate_argnames=("state_pool",),
)
def delta_rule_prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state_pool: jax.Array,
    starts: jax.Array,
    lengths: jax.Array,
    slots: jax.Array,
    fresh: jax.Array,
    *,
    max_len: int | None = None,
    block_v: tuple[int, int] = (16, 128),
    num_warps: tuple[int, int, int] = (4, 4, 4),
    num_stages: tuple[int, int, int] = (1, 4, 2),
    fuse_output: bool = False,
    diag_span_limit: float = DIAG_SPAN_LIMIT,
    products_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Signature of ``delta_rule_varlen_slots`` (``max_len`` is not needed here). ``num_warps``/``num_stages``
    are per kernel (intra, state, output); ``block_v`` is the V-slab of the state and output kernels.
    ``fuse_output`` computes the output inside the state kernel (``_state_output_kernel``). KDA sub-blocks whose
    decay spans more than ``diag_span_limit`` nats take the bounded form of the products kernel (tests force
    either form); ``products_warps`` is the warp count of KDA's products kernel."""
    del max_len
    num_tokens, heads, value_dim = v.shape
    key_heads = q.shape[1]
    if heads % key_heads:
        raise ValueError(f"value heads ({heads}) must be a multiple of key heads ({key_heads})")
    if num_tokens < CHUNK:  # every chunk reads a whole C-token window of the buffer
        pad = lambda x: jnp.pad(x, [(0, CHUNK - num_tokens)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
        o, state_pool = delta_rule_prefill(
            pad(q), pad(k), pad(v), pad(g), pad(beta), state_pool, starts, lengths, slots, fresh,
            block_v=block_v, num_warps=num_warps, num_stages=num_stages, fuse_output=fuse_output,
            diag_span_limit=diag_span_limit, products_warps=products_warps, interpret=interpret)
        return o[:num_tokens], state_pool
    num_chunks = num_tokens // CHUNK + starts.shape[0]
    table = chunk_table(starts.astype(jnp.int32), lengths.astype(jnp.int32), num_tokens, num_chunks)
    w, u, qk, qg, kd, glast = intra(table, q, k, v, g, beta, num_chunks, span_limit=diag_span_limit,
                                    num_warps=num_warps[0], num_stages=num_stages[0], products_warps=products_warps,
                                    interpret=interpret)
    blank = blank_output(starts.astype(jnp.int32), lengths.astype(jnp.int32), v.shape, v.dtype, interpret=interpret)
    if fuse_output:
        return state_output(table, slots, fresh, w, u, kd, glast, qg, qk, state_pool, blank,
                            block_v=block_v[0], num_warps=num_warps[1], num_stages=num_stages[1],
                            interpret=interpret)
    h, v_new, state_pool = state(table[3], table[4], slots, fresh, w, u, kd, glast, state_pool,
                                 block_v=block_v[0], num_warps=num_warps[1], num_stages=num_stages[1],
                                 interpret=interpret)
    o = output(table, qg, h, qk, v_new, blank, block_v=block_v[1], num_warps=num_warps[2],
               num_stages=num_stages[2], interpret=interpret)
    return o, state_pool


def prefill_slots(q, k, v, g, beta, state_pool, starts, lengths, slots, fresh, *, max_len):
    """The dispatch entry for ``delta_rule_varlen_slots``: the kernels where the shapes allow, else the jnp op."""
    from apriel2_jax.ops.delta_rule import delta_rule_varlen_slots

    if not supported(q, v):
        return delta_rule_varlen_slots(q, k, v, g, beta, state_pool, starts, lengths, slots, fresh, max_len=max_len)
    lengths = jnp.minimum(lengths, max_len)  # as the oracle, which sees at most max_len tokens per sequence
    config = dispatch_config(starts.shape[0] * v.shape[1], v.shape[-1], v.dtype)
    return delta_rule_prefill(q, k, v, g, beta, state_pool, starts, lengths, slots, fresh, **config)


def dispatch_config(pairs: int, value_dim: int, dtype) -> dict:
    """The state/output configuration for ``pairs`` (sequence, head) pairs (scripts/sweep_prefill.py, kernel GPU
    times on an H100, bf16, 2026-11-22).

    Many pairs (>= 128, about one per SM): the output comes straight from the register state in wide V-slabs,
    which re-read w and k fewer times (B=8 T=2048 H=32: 390 µs at 128 wide with 8 warps, 452 at 64 with 4; the
    separate kernels took 403 (state at its best, 64 wide) and 260 (output, 128 wide), and 1465 for a 16-wide
    state).
    Few pairs: the sequential state kernel is the critical path, so its V-slabs narrow until about 128 programs
    run (B=1 T=8192 H=16: 126 µs at 16 wide with 4 pipeline stages, 202 at 32 wide with 2), and the
    chunk-parallel output kernel stays separate (68 µs at 128 wide, 88 at 64).
    float32 (parity runs) keeps the narrower tiles validated there: fp32 tiles take twice the shared memory of
    bf16 ones, and bf16 at 128 wide with 3 stages already exceeded it."""
    if dtype == jnp.float32:
        return dict(block_v=(32, 64), num_stages=(1, 2, 2))
    if pairs >= 128:
        return FUSED_CONFIG
    slab = 16
    while slab * 2 <= value_dim and pairs * value_dim // (slab * 2) >= 128:
        slab *= 2
    return dict(block_v=(slab, 128))
