"""Mamba-1 selective scan (Apriel-H1 ``d_xb`` grouping) in Pallas (Triton backend), over the state-slot pool.

Prefill (varlen): one program per (sequence, block of ``bh`` heads). The program loads its [bh, N, N] fp32 state
block (heads x channels-of-head x state) from the pool row of its slot once, then walks the sequence's tokens in a
loop with the state in registers: per token it loads u, delta, z ([bh, N] channels), the group's B row and the
heads' C rows, and applies softplus(delta + dt_bias), the decay exp(dt A), the drive dt u B, the read <C, s>, the
D skip and the silu(z) gate, storing one [bh, N] slab of y. The final state goes back to the same pool row
(in place: the pool is aliased input -> output). The work is memory-bound in principle (every input byte is
read once, the state never leaves registers); the loop body only depends on the previous iteration through the
state FMA, and its loads only on the token index, so Triton can prefetch them (``num_stages``).

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


def _kernel(
    starts_ref, lengths_ref, slots_ref, fresh_ref, pre_ref, hi_ref,
    u_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, z_ref, bias_ref, pool_in_ref,
    y_ref, pool_ref, *, bh, rho, decode, barrier,
):
    del pool_in_ref  # aliased with pool_ref: the pool is updated in place
    seq, hb = pl.program_id(0), pl.program_id(1)
    h0 = hb * bh
    heads = pl.ds(h0, bh)
    group = h0 // rho  # all bh heads of the program read this B group (bh divides rho)
    slot = slots_ref[seq]
    A = -jnp.exp(a_ref[heads, :, :].astype(F32))  # [bh, N(channel), N(state)]
    d_skip = d_ref[heads, :].astype(F32)  # [bh, N]
    dt_bias = bias_ref[heads, :].astype(F32)

    def step(tok, state):
        u = u_ref[tok, heads, :].astype(F32)
        dt = softplus(dt_ref[tok, heads, :].astype(F32) + dt_bias)
        b = b_ref[tok, group, :].astype(F32)  # [N]
        c = c_ref[tok, heads, :].astype(F32)  # [bh, N]
        z = z_ref[tok, heads, :].astype(F32)
        state = jnp.exp(dt[:, :, None] * A) * state + (dt * u)[:, :, None] * b[None, None, :]
        y = jnp.sum(state * c[:, None, :], axis=-1) + d_skip * u
        y = y * (z / (1.0 + jnp.exp(-z)))  # silu(z); written out since the Triton lowering has no logistic
        y_ref[tok, heads, :] = y.astype(y_ref.dtype)
        return state

    def load_state():
        s = pool_ref[slot, heads, :, :]
        return jnp.where(fresh_ref[seq] != 0, jnp.zeros_like(s), s)

    def store_state(state):
        if barrier:  # every thread has read its part of the old state before any thread overwrites the row
            pltriton.debug_barrier()
        pool_ref[slot, heads, :, :] = state

    if decode:
        store_state(step(seq, load_state()))
        return

    start, length = starts_ref[seq], lengths_ref[seq]

    @pl.when(length > 0)
    def _():
        state = jax.lax.fori_loop(start, start + length, step, load_state())
        store_state(state)

    zeros = jnp.zeros((bh, y_ref.shape[-1]), y_ref.dtype)

    def fill(tok, carry):
        y_ref[tok, heads, :] = zeros
        return carry

    jax.lax.fori_loop(pre_ref[seq], start, fill, 0)
    jax.lax.fori_loop(start + length, hi_ref[seq], fill, 0)


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


def _call(u, delta, A_log, B, C, D, z, dt_bias, state_pool, meta, grid_rows, *, decode, heads_per_program,
          num_warps, num_stages, interpret):
    n_tokens, channels = u.shape
    n = A_log.shape[-1]
    heads, rho = _check(u, A_log, B, C, state_pool, heads_per_program)
    bh = heads_per_program
    if dt_bias is None:
        dt_bias = jnp.zeros((channels,), F32)
    per_head = lambda a: a.reshape(a.shape[:-1] + (heads, n))  # noqa: E731  (free reshapes: [.., Din] -> [.., H, N])
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


@functools.partial(
    jax.jit,
    static_argnames=("max_len", "heads_per_program", "num_warps", "num_stages", "interpret"),
    donate_argnames=("state_pool",),
)
def selective_scan_varlen(
    u, delta, A_log, B, C, D, z, dt_bias, state_pool, starts, lengths, slots, fresh, *, max_len,
    heads_per_program=1, num_warps=1, num_stages=2, interpret=False,
):
    """The kernel with the signature of ``ops.mamba.selective_scan_varlen_slots`` (plus tuning knobs): u, delta,
    z [N_tokens, Din]; B [N_tokens, groups, N]; C [N_tokens, heads, N]; state_pool [N_slots, Din, N] fp32, donated
    and updated in place. ``max_len`` only bounds the oracle's padded view; the kernel loops to each length."""
    del max_len
    n_tokens = u.shape[0]
    pre, hi = fill_ranges(starts, lengths, n_tokens)
    i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    meta = (i32(starts), i32(lengths), i32(slots), i32(fresh), pre, hi)
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
    # Untuned default (see scripts/bench_mamba_conv.py): one head (N channels) per program for parallelism when
    # few sequences are in flight.
    return selective_scan_varlen(u, delta, A_log, B, C, D, z, dt_bias, state_pool, starts, lengths, slots, fresh,
                                 max_len=max_len, heads_per_program=_heads_per_program(B, C, 1))


def decode_slots(u, delta, A_log, B, C, D, z, dt_bias, state_pool, slots, fresh):
    """Dispatch entry for "selective_scan_decode_slots"."""
    from apriel2_jax.ops.mamba import selective_scan_decode_slots

    if not supported(u, A_log, B, C, state_pool):
        return selective_scan_decode_slots(u, delta, A_log, B, C, D, z, dt_bias, state_pool, slots, fresh)
    return selective_scan_decode(u, delta, A_log, B, C, D, z, dt_bias, state_pool, slots, fresh,
                                 heads_per_program=_heads_per_program(B, C, 4))
