"""Mamba-1 selective scan (Apriel-H1 ``d_xb`` grouping) in Pallas (Triton backend), over the state-slot pool.

Prefill (varlen): one program per (sequence, block of ``bh`` heads). The program loads its [bh, N, N] fp32 state
block (heads x channels-of-head x state) from the pool row of its slot once, then walks the sequence's tokens in a
loop with the state in registers: per token it loads u, delta, z ([bh, N] channels), the group's B row and the
heads' C rows, and applies softplus(delta + dt_bias), the decay exp(dt A), the drive dt u B, the read <C, s>, the
D skip and the silu(z) gate, storing one [bh, N] slab of y. The final state goes back to the same pool row
(in place: the pool is aliased input -> output). The work is memory-bound in principle (every input byte is
read once, the state never leaves registers); the loop body only depends on the previous iteration through the
state FMA, and its loads only on the token index, so Triton can prefetch them (``num_stages``).

Time-segmented prefill (``segments`` > 1), for few sequences: each sequence is cut into parts scanned in
parallel from zero (pass 1), the parts' start states are chained (pass 2: s_end = exp(A sum dt) s_start +
s_local, linear in the state) and each part is scanned again from its start state, writing y (pass 3).

Heads of a program share one B group (``bh`` divides heads-per-group), so B is one [N] row per token. Arrays are
viewed as [.., heads, N] (free reshapes in XLA) so every block is a power-of-two [bh, N] or [bh, N, N] tile.

Decode: the same body once per row (token = row), one program per (row, head block).

Tokens of the flat buffer that no sequence covers are zero-filled by the programs (see ``fill_ranges``), so the
output is finite everywhere without a separate memset. The references (and CPU path) are
``apriel2_jax.ops.mamba.selective_scan_varlen_slots`` / ``selective_scan_decode_slots``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fill_ranges(starts: jax.Array, lengths: jax.Array, n_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Per sequence, the token ranges it zero-fills so that every token of the buffer is written exactly once:
    [pre, start) (only the sequence with the smallest start: the tokens before it) and [start+length, hi), up to
    the next distinct start (or the end of the buffer). When several sequences share a start, only the longest
    (then the first) fills; the others get empty ranges. O(S^2) on [S] metadata: negligible.
    Returns (pre [S], hi [S]) int32."""
    starts = starts.astype(jnp.int32)
    lengths = lengths.astype(jnp.int32)
    s = starts.shape[0]
    idx = jnp.arange(s)
    same = starts[:, None] == starts[None, :]
    beats = (lengths[None, :] > lengths[:, None]) | ((lengths[None, :] == lengths[:, None]) & (idx[None, :] < idx[:, None]))
    owner = ~jnp.any(same & beats, axis=1)
    later = jnp.where(starts[None, :] > starts[:, None], starts[None, :], n_tokens)
    nxt = jnp.min(later, axis=1)
    end = starts + lengths
    hi = jnp.where(owner, jnp.clip(nxt, end, n_tokens), end)
    first = owner & (starts == jnp.min(starts))
    pre = jnp.where(first, 0, starts)
    return pre, hi


def softplus(x):
    """torch softplus with threshold 20, as ``apriel2_jax.ops.norms.softplus``."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _token_step(u_ref, dt_ref, b_ref, c_ref, z_ref, y_ref, heads, group, A, d_skip, dt_bias):
    """The scan's body for one token: state update, read, D skip and silu(z) gate; y stored unless ``y_ref`` is
    None (the segment-state pass only needs the state, and the summed dt for the segment's decay)."""

    def step(tok, carry):
        state, dt_sum = carry
        u = u_ref[tok, heads, :].astype(F32)
        dt = softplus(dt_ref[tok, heads, :].astype(F32) + dt_bias)
        b = b_ref[tok, group, :].astype(F32)  # [N]
        state = jnp.exp(dt[:, :, None] * A) * state + (dt * u)[:, :, None] * b[None, None, :]
        if y_ref is not None:
            c = c_ref[tok, heads, :].astype(F32)  # [bh, N]
            z = z_ref[tok, heads, :].astype(F32)
            y = jnp.sum(state * c[:, None, :], axis=-1) + d_skip * u
            y = y * (z / (1.0 + jnp.exp(-z)))  # silu(z); written out since the Triton lowering has no logistic
            y_ref[tok, heads, :] = y.astype(y_ref.dtype)
        return state, dt_sum + dt

    return step


def _head_block(a_ref, d_ref, bias_ref, hb, bh, rho):
    """The program's heads, its B group (bh divides the heads per group) and their A, D and dt bias."""
    heads = pl.ds(hb * bh, bh)
    A = -jnp.exp(a_ref[heads, :, :].astype(F32))  # [bh, N(channel), N(state)]
    return heads, (hb * bh) // rho, A, d_ref[heads, :].astype(F32), bias_ref[heads, :].astype(F32)


def _segment(start, length, part, segments):
    """Tokens [lo, hi) of part ``part`` of a sequence cut into ``segments`` near-equal parts."""
    size = (length + segments - 1) // segments
    return start + jnp.minimum(part * size, length), start + jnp.minimum((part + 1) * size, length)


def _fill_gaps(y_ref, pre, start, length, hi, heads, bh):
    zeros = jnp.zeros((bh, y_ref.shape[-1]), y_ref.dtype)

    def fill(tok, carry):
        y_ref[tok, heads, :] = zeros
        return carry

    jax.lax.fori_loop(pre, start, fill, 0)
    jax.lax.fori_loop(start + length, hi, fill, 0)


def _kernel(
    starts_ref, lengths_ref, slots_ref, fresh_ref, pre_ref, hi_ref,
    u_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, z_ref, bias_ref, pool_in_ref,
    y_ref, pool_ref, *, bh, rho, decode, barrier,
):
    del pool_in_ref  # aliased with pool_ref: the pool is updated in place
    seq, hb = pl.program_id(0), pl.program_id(1)
    heads, group, A, d_skip, dt_bias = _head_block(a_ref, d_ref, bias_ref, hb, bh, rho)
    slot = slots_ref[seq]
    step = _token_step(u_ref, dt_ref, b_ref, c_ref, z_ref, y_ref, heads, group, A, d_skip, dt_bias)
    no_dt = jnp.zeros((bh, A.shape[1]), F32)

    def load_state():
        s = pool_ref[slot, heads, :, :]
        return jnp.where(fresh_ref[seq] != 0, jnp.zeros_like(s), s)

    def store_state(state):
        if barrier:  # every thread has read its part of the old state before any thread overwrites the row
            pltriton.debug_barrier()
        pool_ref[slot, heads, :, :] = state

    if decode:
        store_state(step(seq, (load_state(), no_dt))[0])
        return

    start, length = starts_ref[seq], lengths_ref[seq]

    @pl.when(length > 0)
    def _():
        state, _ = jax.lax.fori_loop(start, start + length, step, (load_state(), no_dt))
        store_state(state)

    _fill_gaps(y_ref, pre_ref[seq], start, length, hi_ref[seq], heads, bh)


# Time-segmented prefill, for few sequences: the one-pass kernel above has only (sequences x head blocks)
# programs, each walking its whole sequence one token at a time (B=1, T=8192, Din=4096 on an H100: 8.2 ms, 1.5%
# of the byte roofline). The recurrence is linear in the state, s_end = exp(A sum(dt)) s_start + s_local, so
# each of ``segments`` parts of a sequence can be scanned from zero at once (pass 1), the parts' start states
# chained in a short loop (pass 2), and each part scanned again from its true start state, writing y (pass 3).


def _segment_state_kernel(starts_ref, lengths_ref, u_ref, dt_ref, a_ref, b_ref, d_ref, bias_ref, local_ref,
                          dt_sum_ref, *, bh, rho, segments):
    """Pass 1 over (sequence, head block, part): the part's final state from a zero start, and its summed dt."""
    seq, hb, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads, group, A, d_skip, dt_bias = _head_block(a_ref, d_ref, bias_ref, hb, bh, rho)
    lo, hi = _segment(starts_ref[seq], lengths_ref[seq], part, segments)
    step = _token_step(u_ref, dt_ref, b_ref, None, None, None, heads, group, A, d_skip, dt_bias)
    zero = jnp.zeros((bh,) + A.shape[1:], F32)
    state, dt_sum = jax.lax.fori_loop(lo, hi, step, (zero, jnp.zeros((bh, A.shape[1]), F32)))
    local_ref[seq, part, heads, :, :] = state
    dt_sum_ref[seq, part, heads, :] = dt_sum


def _segment_chain_kernel(lengths_ref, slots_ref, fresh_ref, a_ref, local_ref, dt_sum_ref, pool_in_ref,
                          first_ref, pool_ref, *, bh, segments, barrier):
    """Pass 2 over (sequence, head block): each part's start state, and the sequence's final state into the pool."""
    del pool_in_ref  # aliased with pool_ref
    seq, hb = pl.program_id(0), pl.program_id(1)
    heads = pl.ds(hb * bh, bh)
    A = -jnp.exp(a_ref[heads, :, :].astype(F32))
    slot = slots_ref[seq]
    state = pool_ref[slot, heads, :, :]
    state = jnp.where(fresh_ref[seq] != 0, jnp.zeros_like(state), state)

    def chain(part, s):
        first_ref[seq, part, heads, :, :] = s
        decay = jnp.exp(dt_sum_ref[seq, part, heads, :][:, :, None] * A)
        return decay * s + local_ref[seq, part, heads, :, :]

    state = jax.lax.fori_loop(0, segments, chain, state)

    @pl.when(lengths_ref[seq] > 0)
    def _():
        if barrier:
            pltriton.debug_barrier()
        pool_ref[slot, heads, :, :] = state


def _segment_output_kernel(starts_ref, lengths_ref, pre_ref, hi_ref, u_ref, dt_ref, a_ref, b_ref, c_ref, d_ref,
                           z_ref, bias_ref, first_ref, y_ref, *, bh, rho, segments):
    """Pass 3 over (sequence, head block, part): the part's scan from its start state, writing y; part 0 also
    zero-fills the sequence's gap tokens."""
    seq, hb, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads, group, A, d_skip, dt_bias = _head_block(a_ref, d_ref, bias_ref, hb, bh, rho)
    start, length = starts_ref[seq], lengths_ref[seq]
    lo, hi = _segment(start, length, part, segments)
    step = _token_step(u_ref, dt_ref, b_ref, c_ref, z_ref, y_ref, heads, group, A, d_skip, dt_bias)
    jax.lax.fori_loop(lo, hi, step, (first_ref[seq, part, heads, :, :], jnp.zeros((bh, A.shape[1]), F32)))

    @pl.when(part == 0)
    def _():
        _fill_gaps(y_ref, pre_ref[seq], start, length, hi_ref[seq], heads, bh)


def _check(u, A_log, B, C, state_pool, heads_per_program):
    """Shapes the kernel can take; raises ValueError (the dispatch entry falls back instead)."""
    channels = u.shape[-1]
    n = A_log.shape[-1]
    if not is_power_of_two(n):
        raise ValueError(f"state size {n} is not a power of two (Triton blocks must be)")
    if channels % n or A_log.shape != (channels, n) or state_pool.shape[1:] != (channels, n):
        raise ValueError(f"inconsistent shapes: u {u.shape}, A_log {A_log.shape}, state_pool {state_pool.shape}")
    heads, groups = channels // n, B.shape[-2]
    if C.shape[-2:] != (heads, n) or B.shape[-1] != n or groups == 0 or heads % groups:
        raise ValueError(f"B {B.shape} / C {C.shape} do not match {heads} heads of size {n}")
    rho = heads // groups
    if not is_power_of_two(heads_per_program) or rho % heads_per_program:
        raise ValueError(f"heads_per_program={heads_per_program} must be a power of two dividing {rho} heads per group")
    return heads, rho


def _prepare(u, A_log, B, C, dt_bias, state_pool, heads_per_program):
    """Checked geometry shared by the one-pass and segmented prefill: (heads, heads per B group, N, dt bias (zeros
    if None), the free reshape [.., Din] -> [.., heads, N])."""
    heads, rho = _check(u, A_log, B, C, state_pool, heads_per_program)
    n = A_log.shape[-1]
    if dt_bias is None:
        dt_bias = jnp.zeros((u.shape[-1],), F32)
    return heads, rho, n, dt_bias, lambda a: a.reshape(a.shape[:-1] + (heads, n))


def _call(u, delta, A_log, B, C, D, z, dt_bias, state_pool, meta, grid_rows, *, decode, heads_per_program,
          num_warps, num_stages, interpret):
    n_tokens, channels = u.shape
    heads, rho, n, dt_bias, per_head = _prepare(u, A_log, B, C, dt_bias, state_pool, heads_per_program)
    bh = heads_per_program
    pool_shape = state_pool.shape
    kernel = functools.partial(_kernel, bh=bh, rho=rho, decode=decode, barrier=not interpret)
    y, pool = pl.pallas_call(
        kernel,
        grid=(grid_rows, heads // bh),
        out_shape=(jax.ShapeDtypeStruct((n_tokens, heads, n), u.dtype),
                   jax.ShapeDtypeStruct((pool_shape[0], heads, n, n), F32)),
        input_output_aliases={14: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*meta, per_head(u), per_head(delta), A_log.reshape(heads, n, n), B, C, per_head(D), per_head(z),
      per_head(dt_bias), state_pool.astype(F32).reshape(pool_shape[0], heads, n, n))
    return y.reshape(n_tokens, channels), pool.reshape(pool_shape)


def _call_segmented(u, delta, A_log, B, C, D, z, dt_bias, state_pool, meta, *, segments, heads_per_program,
                    num_warps, num_stages, interpret):
    """The three passes of the time-segmented prefill (see ``_segment_state_kernel``). Its per-part states take
    rows x segments x Din x N x 4 bytes twice (2.1 GB at 256 rows, 32 segments, Din 4096, N 16): a dispatch rule
    must bound rows x segments, which suits few long sequences anyway."""
    n_tokens = u.shape[0]
    heads, rho, n, dt_bias, per_head = _prepare(u, A_log, B, C, dt_bias, state_pool, heads_per_program)
    bh = heads_per_program
    starts, lengths, slots, fresh, pre, hi = meta
    rows = starts.shape[0]
    a3 = A_log.reshape(heads, n, n)
    pool_shape = state_pool.shape
    pool = state_pool.astype(F32).reshape(pool_shape[0], heads, n, n)
    sds = jax.ShapeDtypeStruct
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    per_part = (rows, segments, heads, n, n)
    local, dt_sum = pl.pallas_call(
        functools.partial(_segment_state_kernel, bh=bh, rho=rho, segments=segments),
        grid=(rows, heads // bh, segments), out_shape=(sds(per_part, F32), sds(per_part[:-1], F32)),
        compiler_params=params, interpret=interpret, name="selective_scan_segment_state",
    )(starts, lengths, per_head(u), per_head(delta), a3, B, per_head(D), per_head(dt_bias))
    first, pool = pl.pallas_call(
        functools.partial(_segment_chain_kernel, bh=bh, segments=segments, barrier=not interpret),
        grid=(rows, heads // bh), out_shape=(sds(per_part, F32), sds(pool.shape, F32)),
        input_output_aliases={6: 1}, compiler_params=params, interpret=interpret, name="selective_scan_segment_chain",
    )(lengths, slots, fresh, a3, local, dt_sum, pool)
    y = pl.pallas_call(
        functools.partial(_segment_output_kernel, bh=bh, rho=rho, segments=segments),
        grid=(rows, heads // bh, segments), out_shape=sds((n_tokens, heads, n), u.dtype),
        compiler_params=params, interpret=interpret, name="selective_scan_segment_output",
    )(starts, lengths, pre, hi, per_head(u), per_head(delta), a3, B, C, per_head(D), per_head(z), per_head(dt_bias),
      first)
    return y.reshape(u.shape), pool.reshape(pool_shape)


@functools.partial(
    jax.jit,
    static_argnames=("max_len", "heads_per_program", "num_warps", "num_stages", "segments", "interpret"),
    donate_argnames=("state_pool",),
)
def selective_scan_varlen(
    u, delta, A_log, B, C, D, z, dt_bias, state_pool, starts, lengths, slots, fresh, *, max_len,
    heads_per_program=1, num_warps=1, num_stages=2, segments=1, interpret=False,
):
    """The kernel with the signature of ``ops.mamba.selective_scan_varlen_slots`` (plus tuning knobs): u, delta,
    z [N_tokens, Din]; B [N_tokens, groups, N]; C [N_tokens, heads, N]; state_pool [N_slots, Din, N] fp32, donated
    and updated in place. ``max_len`` only bounds the oracle's padded view; the kernel loops to each length.
    ``segments`` > 1 cuts each sequence into that many parts scanned in parallel (three passes)."""
    del max_len
    n_tokens = u.shape[0]
    if segments < 1:
        raise ValueError(f"segments={segments} must be >= 1")
    pre, hi = fill_ranges(starts, lengths, n_tokens)
    i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    meta = (i32(starts), i32(lengths), i32(slots), i32(fresh), pre, hi)
    if segments > 1:
        return _call_segmented(u, delta, A_log, B, C, D, z, dt_bias, state_pool, meta, segments=segments,
                               heads_per_program=heads_per_program, num_warps=num_warps, num_stages=num_stages,
                               interpret=interpret)
    return _call(u, delta, A_log, B, C, D, z, dt_bias, state_pool, meta, starts.shape[0], decode=False,
                 heads_per_program=heads_per_program, num_warps=num_warps, num_stages=num_stages, interpret=interpret)


@functools.partial(
    jax.jit, static_argnames=("heads_per_program", "num_warps", "num_stages", "interpret"),
    donate_argnames=("state_pool",),
)
def selective_scan_decode(
    u, delta, A_log, B, C, D, z, dt_bias, state_pool, slots, fresh, *,
    heads_per_program=4, num_warps=4, num_stages=1, interpret=False,
):
    """The kernel with the signature of ``ops.mamba.selective_scan_decode_slots``: one token per row."""
    rows = u.shape[0]
    zeros = jnp.zeros((rows,), jnp.int32)
    meta = (zeros, zeros, slots.astype(jnp.int32), fresh.astype(jnp.int32), zeros, zeros)
    return _call(u, delta, A_log, B, C, D, z, dt_bias, state_pool, meta, rows, decode=True,
                 heads_per_program=heads_per_program, num_warps=num_warps, num_stages=num_stages, interpret=interpret)


def _heads_per_program(B: jax.Array, C: jax.Array, target: int) -> int:
    """Largest power of two <= target dividing the heads per group (1 always works)."""
    rho = C.shape[-2] // B.shape[-2] if B.shape[-2] and C.shape[-2] % B.shape[-2] == 0 else 1
    bh = 1
    while bh * 2 <= target and rho % (bh * 2) == 0:
        bh *= 2
    return bh


def supported(u, A_log, B, C, state_pool) -> bool:
    try:
        _check(u, A_log, B, C, state_pool, 1)
    except ValueError:
        return False
    return state_pool.dtype == F32


def varlen_slots(u, delta, A_log, B, C, D, z, dt_bias, state_pool, starts, lengths, slots, fresh, *, max_len):
    """Dispatch entry for "selective_scan_varlen_slots": the kernel where it can take the shapes, else the op."""
    from apriel2_jax.ops.mamba import selective_scan_varlen_slots

    if not supported(u, A_log, B, C, state_pool):
        return selective_scan_varlen_slots(u, delta, A_log, B, C, D, z, dt_bias, state_pool, starts, lengths,
                                           slots, fresh, max_len=max_len)
    # One head (N channels) per program for parallelism when few sequences are in flight, and the sequences cut
    # into time segments (see _segments).
    return selective_scan_varlen(u, delta, A_log, B, C, D, z, dt_bias, state_pool, starts, lengths, slots, fresh,
                                 max_len=max_len, heads_per_program=_heads_per_program(B, C, 1),
                                 segments=_segments(starts.shape[0], max_len, u.shape[-1], state_pool.shape[-1]))


def _segments(rows: int, max_len: int | None, channels: int, state_size: int) -> int:
    """Time segments for the prefill scan. Measured on an H100 (Din 4096, N 16; scripts/bench_mamba_conv.py
    --segments, 2026-11-22): B=1 T=8192 8.58 ms in one pass, 1.68 ms with 8 segments, 1.49 ms with 32; B=8 T=2048
    3.00 / 2.90 / 2.78 ms. So: up to 32 segments while rows x segments <= 256 (the per-part states stay under
    256 x Din x N x 8 bytes, 134 MB at Din 4096, N 16) and each segment keeps >= 64 tokens of the longest
    sequence (B=8 T=2048 was fastest at 64)."""
    if max_len is None:
        return 1
    budget = 256 * 4096 * 16  # rows x segments x Din x N at the measured bound
    segments = 1
    while (segments * 2 <= 32 and rows * segments * 2 * channels * state_size <= budget
           and max_len // (segments * 2) >= 64):
        segments *= 2
    return segments


def decode_slots(u, delta, A_log, B, C, D, z, dt_bias, state_pool, slots, fresh):
    """Dispatch entry for "selective_scan_decode_slots"."""
    from apriel2_jax.ops.mamba import selective_scan_decode_slots

    if not supported(u, A_log, B, C, state_pool):
        return selective_scan_decode_slots(u, delta, A_log, B, C, D, z, dt_bias, state_pool, slots, fresh)
    return selective_scan_decode(u, delta, A_log, B, C, D, z, dt_bias, state_pool, slots, fresh,
                                 heads_per_program=_heads_per_program(B, C, 4))
