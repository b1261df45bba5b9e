"""Causal depthwise conv1d (K taps) in Pallas (Triton backend), over the state-slot pool.

Prefill (varlen): one program per (sequence, channel block, token block). Output row t of a sequence is
sum_j w[j] * window[t + j] over the window [state ‖ x] (K-1 old inputs, then the sequence), so the program does
K shifted [bt, bc] loads and FMAs: tap j reads the rows shifted back by K-1-j; rows before the sequence's first
token come from the pool row of its slot (zeros when fresh). The K loads of a block overlap by all but K-1 rows,
so HBM sees each input about once (the rest hits L1/L2). Elementwise, memory-bound.

The token-block-0 program of each (sequence, channel block) is the only one that reads the old state, so it also
writes the new one (the last K-1 inputs before the sequence's end, older state inputs included when the
sequence is shorter than K-1) after a block barrier, in place (the pool is aliased input -> output). It also
zero-fills the tokens of the flat buffer that no sequence covers (``selective_scan.fill_ranges``), so the output
is finite everywhere.

Decode: one program per (row, channel block): window = [K-1 state rows ‖ x], one output row, state shifted by
one.

The references (and CPU path) are ``apriel2_jax.ops.conv.causal_conv1d_varlen_slots`` / ``..._decode_slots``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .selective_scan import fill_ranges, is_power_of_two

F32 = jnp.float32


def _silu(x):
    return x / (1.0 + jnp.exp(-x))  # the Triton lowering has no logistic


def _varlen_kernel(
    starts_ref, lengths_ref, slots_ref, fresh_ref, pre_ref, hi_ref, x_ref, w_ref, b_ref, pool_in_ref,
    y_ref, pool_ref, *, taps, bt, bc, silu, n_tokens, barrier,
):
    del pool_in_ref  # aliased with pool_ref: the pool is updated in place
    seq, cb, tb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, length, slot = starts_ref[seq], lengths_ref[seq], slots_ref[seq]
    fresh = fresh_ref[seq] != 0
    hist = taps - 1
    c0 = cb * bc
    chans = pl.ds(c0, bc)
    cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (1, bc), 1)  # [1, bc]
    xdt = x_ref.dtype
    shape = (bt, bc)
    iota = jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0)  # [bt, 1]
    p0 = tb * bt

    @pl.when(p0 < length)
    def _():
        p = p0 + iota  # local positions of the block's output rows
        acc = jnp.zeros(shape, F32)
        for j in range(taps):
            q = p - (hist - j)  # local position of tap j's input; < 0: the old state
            in_x = jnp.broadcast_to((q >= 0) & (q < length), shape)
            rows = jnp.clip(start + q, 0, n_tokens - 1)  # in-bounds addresses; the mask picks the lanes
            xv = pltriton.load(x_ref.at[jnp.broadcast_to(rows, shape), jnp.broadcast_to(cols, shape)],
                               mask=in_x, other=0)
            in_state = jnp.broadcast_to((q < 0) & jnp.logical_not(fresh), shape)
            srow = jnp.broadcast_to(jnp.clip(q + hist, 0, hist - 1), shape)
            sv = pltriton.load(pool_ref.at[slot, srow, jnp.broadcast_to(cols, shape)], mask=in_state, other=0)
            # The old state passes through x's dtype, as the reference concatenates [state.astype(x) ‖ x].
            v = xv.astype(F32) + sv.astype(xdt).astype(F32)
            acc = acc + v * w_ref[j, chans].astype(F32)[None, :]
        acc = acc + b_ref[chans].astype(F32)[None, :]
        if silu:
            acc = _silu(acc)
        # Masked lanes may point past the buffer: never accessed on GPU, dropped by the interpreter's scatter.
        out_rows = jnp.broadcast_to(start + p, shape)
        pltriton.store(y_ref.at[out_rows, jnp.broadcast_to(cols, shape)], acc.astype(y_ref.dtype),
                       mask=jnp.broadcast_to(p < length, shape))

    @pl.when((tb == 0) & (length > 0))
    def _():
        new = []
        for i in range(hist):
            q = length - hist + i  # local position of the new state's row i
            xv = x_ref[jnp.clip(start + q, 0, n_tokens - 1), chans]
            sv = pool_ref[slot, jnp.clip(q + hist, 0, hist - 1), chans].astype(xdt)
            sv = jnp.where(fresh, jnp.zeros_like(sv), sv)
            new.append(jnp.where(q >= 0, xv, sv).astype(pool_ref.dtype))
        if barrier:  # every thread of the program has read the old state before the row is overwritten
            pltriton.debug_barrier()
        for i in range(hist):
            pool_ref[slot, i, chans] = new[i]

    @pl.when(tb == 0)
    def _():
        zeros = jnp.zeros(shape, y_ref.dtype)

        def fill(lo, hi):
            def body(i, carry):
                rows = lo + i * bt + iota
                pltriton.store(y_ref.at[jnp.broadcast_to(rows, shape), jnp.broadcast_to(cols, shape)], zeros,
                               mask=jnp.broadcast_to(rows < hi, shape))
                return carry

            jax.lax.fori_loop(0, jax.lax.div(hi - lo + bt - 1, bt), body, 0)

        fill(pre_ref[seq], start)
        fill(start + length, hi_ref[seq])


def previous_inputs(pool_ref, slot, fresh, cols, dtype):
    """One decode row's window before its input: the K-1 previous inputs of channels ``cols`` in its pool slot
    [P, K-1, C] (zeros for a fresh row), in ``dtype``. Shared by every kernel that runs a decode conv."""
    window = []
    for i in range(pool_ref.shape[1]):
        s = pool_ref[slot, i, cols].astype(dtype)
        window.append(jnp.where(fresh, jnp.zeros_like(s), s))
    return window


def decode_output(window, x, w_ref, b_ref, cols, silu=True):
    """fp32 ``act(bias + sum_j w[j] [*window, x][j])`` of channels ``cols``; weights [K, C]."""
    acc = b_ref[cols].astype(F32)
    for j, value in enumerate([*window, x]):
        acc = acc + value.astype(F32) * w_ref[j, cols].astype(F32)
    return _silu(acc) if silu else acc


def store_state(pool_ref, slot, cols, window, x):
    """The slot's new state at ``cols``: the window shifted by one, ending with this step's input ``x``. After
    every load of the old state (a barrier where threads could store what others still read)."""
    for i, value in enumerate([*window[1:], x]):
        pool_ref[slot, i, cols] = value.astype(pool_ref.dtype)


def _decode_kernel(slots_ref, fresh_ref, x_ref, w_ref, b_ref, pool_in_ref, y_ref, pool_ref, *, bc, silu, barrier,
                   x_offset, over_input):
    del pool_in_ref
    row, cb = pl.program_id(0), pl.program_id(1)
    chans = pl.ds(cb * bc, bc)
    slot = slots_ref[row]
    window = previous_inputs(pool_ref, slot, fresh_ref[row] != 0, chans, x_ref.dtype)
    x = x_ref[row, pl.ds(x_offset + cb * bc, bc)]
    acc = decode_output(window, x, w_ref, b_ref, chans, silu)
    if not over_input:
        y_ref[row, chans] = acc.astype(y_ref.dtype)
    if barrier:  # every load (of the old state, of x where y overwrites it) before a store
        pltriton.debug_barrier()
    if over_input:
        y_ref[row, pl.ds(x_offset + cb * bc, bc)] = acc.astype(y_ref.dtype)
    store_state(pool_ref, slot, chans, window, x)


def _check(x, weight, conv_pool, activation, block_c, block_t=None):
    """Shapes the kernel can take; raises ValueError (the dispatch entry falls back instead)."""
    channels = x.shape[-1]
    taps = weight.shape[-1]
    if weight.shape != (channels, taps) or conv_pool.shape[1:] != (taps - 1, channels):
        raise ValueError(f"inconsistent shapes: x {x.shape}, weight {weight.shape}, conv_pool {conv_pool.shape}")
    if taps < 2:
        raise ValueError("the kernel needs K >= 2 taps (a state of K-1 >= 1 inputs)")
    if activation not in ("silu", None):
        raise ValueError(f"activation {activation!r} is not fused in the kernel (silu or None)")
    if not is_power_of_two(block_c) or channels % block_c:
        raise ValueError(f"block_c={block_c} must be a power of two dividing {channels} channels")
    if block_t is not None and (not is_power_of_two(block_t) or block_t < taps - 1):
        raise ValueError(f"block_t={block_t} must be a power of two >= K-1 = {taps - 1}")


def _bias(bias, channels):
    return jnp.zeros((channels,), F32) if bias is None else bias


@functools.partial(
    jax.jit,
    static_argnames=("max_len", "activation", "block_c", "block_t", "num_warps", "num_stages", "interpret"),
    donate_argnames=("conv_pool",),
)
def causal_conv1d_varlen(
    x, weight, bias, conv_pool, starts, lengths, slots, fresh, *, max_len, activation="silu",
    block_c=256, block_t=32, num_warps=4, num_stages=1, interpret=False,
):
    """The kernel with the signature of ``ops.conv.causal_conv1d_varlen_slots`` (plus tuning knobs): x
    [N_tokens, C]; weight [C, K]; conv_pool [N_slots, K-1, C], donated and updated in place; max_len (static)
    sets the token-block grid, so every length must be <= max_len."""
    n_tokens, channels = x.shape
    taps = weight.shape[-1]
    block_c = min(block_c, channels)
    _check(x, weight, conv_pool, activation, block_c, block_t)
    pre, hi = fill_ranges(starts, lengths, n_tokens)
    i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    kernel = functools.partial(_varlen_kernel, taps=taps, bt=block_t, bc=block_c, silu=activation == "silu",
                               n_tokens=n_tokens, barrier=not interpret)
    return pl.pallas_call(
        kernel,
        grid=(starts.shape[0], channels // block_c, max(1, -(-max_len // block_t))),
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype)),
        input_output_aliases={9: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(i32(starts), i32(lengths), i32(slots), i32(fresh), pre, hi, x, weight.T, _bias(bias, channels), conv_pool)


@functools.partial(
    jax.jit, static_argnames=("activation", "x_offset", "over_input", "block_c", "num_warps", "num_stages",
                              "interpret"),
    donate_argnames=("conv_pool",),
)
def causal_conv1d_decode(
    x, weight, bias, conv_pool, slots, fresh, activation="silu", *, x_offset=0, over_input=False, block_c=256,
    num_warps=2, num_stages=1, interpret=False,
):
    """The kernel with the signature of ``ops.conv.causal_conv1d_decode_slots``: x [S, C] (or wider, the input at
    columns [x_offset, x_offset + C), read in place), one token per row. ``over_input``: y is x's whole buffer with
    the conv's output over its input columns (the buffer aliased, so XLA copies x only where it is still read)."""
    rows, channels = x.shape[0], weight.shape[0]
    if x.ndim != 2 or not 0 <= x_offset <= x.shape[1] - channels:
        raise ValueError(f"conv input must be [S, >= {x_offset} + {channels}], got {list(x.shape)}")
    block_c = min(block_c, channels)
    _check(jax.ShapeDtypeStruct((rows, channels), x.dtype), weight, conv_pool, activation, block_c)
    kernel = functools.partial(_decode_kernel, bc=block_c, silu=activation == "silu", barrier=not interpret,
                               x_offset=x_offset, over_input=over_input)
    return pl.pallas_call(
        kernel,
        grid=(rows, channels // block_c),
        out_shape=(jax.ShapeDtypeStruct(x.shape if over_input else (rows, channels), x.dtype),
                   jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype)),
        input_output_aliases={2: 0, 5: 1} if over_input else {5: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(slots.astype(jnp.int32), fresh.astype(jnp.int32), x, weight.T, _bias(bias, channels), conv_pool)


def _block_c(channels: int, target: int) -> int:
    """Largest power of two <= target dividing the channels."""
    block = 1
    while block * 2 <= target and channels % (block * 2) == 0:
        block *= 2
    return block


def supported(x, weight, conv_pool, activation) -> bool:
    channels = x.shape[-1]
    block = _block_c(channels, 256)
    if block < 8:  # too narrow to be worth a kernel (and not a real model's channel count)
        return False
    try:
        _check(x, weight, conv_pool, activation, block)
    except ValueError:
        return False
    return True


def varlen_slots(x, weight, bias, conv_pool, starts, lengths, slots, fresh, *, max_len, activation="silu"):
    """Dispatch entry for "causal_conv1d_varlen_slots": the kernel where it can take the shapes, else the op."""
    from apriel2_jax.ops.conv import causal_conv1d_varlen_slots

    if not supported(x, weight, conv_pool, activation) or weight.shape[-1] - 1 > 32:
        return causal_conv1d_varlen_slots(x, weight, bias, conv_pool, starts, lengths, slots, fresh,
                                          max_len=max_len, activation=activation)
    # Token blocks of 32 rows, smaller for short chunks (fewer masked lanes), never below K-1 (one block of
    # history). Untuned default: see scripts/bench_mamba_conv.py.
    block_t = max(min(32, 1 << max(0, max_len - 1).bit_length()), 1 << max(0, weight.shape[-1] - 2).bit_length())
    return causal_conv1d_varlen(x, weight, bias, conv_pool, starts, lengths, slots, fresh, max_len=max_len,
                                activation=activation, block_c=_block_c(x.shape[-1], 256), block_t=block_t)


def decode_slots(x, weight, bias, conv_pool, slots, fresh, activation="silu", *, x_offset=0):
    """Dispatch entry for "causal_conv1d_decode_slots"."""
    from apriel2_jax.ops.conv import causal_conv1d_decode_slots

    channels = weight.shape[0]
    if x.ndim != 2 or not 0 <= x_offset <= x.shape[1] - channels or x_offset % 8 \
            or not supported(jax.ShapeDtypeStruct((x.shape[0], channels), x.dtype), weight, conv_pool, activation):
        return causal_conv1d_decode_slots(x, weight, bias, conv_pool, slots, fresh, activation, x_offset=x_offset)
    return causal_conv1d_decode(x, weight, bias, conv_pool, slots, fresh, activation, x_offset=x_offset,
                                block_c=_block_c(channels, 256))


def decode_slots_over_input(x, weight, bias, conv_pool, slots, fresh, activation="silu"):
    """The conv of x's first C columns (C the weight's channels) written over them: [S, >= C] -> x's shape, and the
    pool. The kernel where it takes the shapes, else the jnp op and a concatenation."""
    from apriel2_jax.ops.conv import causal_conv1d_decode_slots

    channels = weight.shape[0]
    if x.ndim != 2 or x.shape[1] < channels \
            or not supported(jax.ShapeDtypeStruct((x.shape[0], channels), x.dtype), weight, conv_pool, activation):
        y, conv_pool = causal_conv1d_decode_slots(x, weight, bias, conv_pool, slots, fresh, activation)
        return jnp.concatenate([y, x[:, channels:]], axis=-1), conv_pool
    return causal_conv1d_decode(x, weight, bias, conv_pool, slots, fresh, activation, over_input=True,
                                block_c=_block_c(channels, 256))
