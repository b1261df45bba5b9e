"""Causal conv1d kernels (varlen prefill and decode over the slot pool): interpret mode against the jnp oracles on
CPU, and cross-lowering for CUDA at production shapes (Triton power-of-two and layout rules)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops.conv import causal_conv1d_decode_slots, causal_conv1d_varlen_slots
from pallas_kernels.causal_conv1d import (
    causal_conv1d_decode,
    causal_conv1d_varlen,
    decode_slots,
    supported,
    varlen_slots,
)

# (start, length, slot, fresh): packed with gaps, out-of-order slots, lengths 0, 1, 2 (< K-1: the new state keeps
# old state inputs), odd lengths, a fresh row, a sequence ending at the buffer's end.
SEQS = [(30, 11, 3, False), (2, 7, 5, False), (9, 1, 2, False), (10, 0, 0, False), (12, 13, 6, True), (25, 2, 1, False)]
N_TOKENS, N_SLOTS, MAX_LEN = 41, 8, 16


def _meta(seqs=SEQS):
    starts, lengths, slots, fresh = (np.asarray(c) for c in zip(*seqs))
    return (jnp.asarray(starts, jnp.int32), jnp.asarray(lengths, jnp.int32), jnp.asarray(slots, jnp.int32),
            jnp.asarray(fresh))


def _inputs(seed, tokens=N_TOKENS, channels=16, kernel=4, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    return f(tokens, channels), f(channels, kernel), f(channels), f(N_SLOTS, kernel - 1, channels)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("dtype, tol, kernel, bias, activation, block_t", [
    (jnp.float32, 1e-5, 4, True, "silu", 4),
    (jnp.float32, 1e-5, 3, False, None, 8),
    (jnp.bfloat16, 1e-2, 4, True, "silu", 4),
])
def test_varlen_kernel_matches_oracle(dtype, tol, kernel, bias, activation, block_t):
    x, w, b, pool = _inputs(0, kernel=kernel, dtype=dtype)
    b = b if bias else None
    meta = _meta()
    y_ref, pool_ref = causal_conv1d_varlen_slots(x, w, b, pool, *meta, max_len=MAX_LEN, activation=activation)
    y, new_pool = causal_conv1d_varlen(x, w, b, jnp.array(pool, copy=True), *meta, max_len=MAX_LEN,
                                       activation=activation, block_c=8, block_t=block_t, interpret=True)
    covered = np.zeros(N_TOKENS, bool)
    for start, length, *_ in SEQS:
        covered[start:start + length] = True
    y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
    assert _rel(y[covered], y_ref[covered]) <= tol
    assert np.all(y[~covered] == 0)  # zero-filled, not left uninitialised
    # The new state is a copy of inputs: exact, including the old-state rows kept by the 1- and 2-token sequences.
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32), np.asarray(pool_ref, np.float32))
    untouched = [0, 4, 7]  # incl. the sink slot of the empty row
    np.testing.assert_array_equal(np.asarray(new_pool)[untouched], np.asarray(pool)[untouched])


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_decode_kernel_matches_oracle(dtype, tol):
    x, w, b, pool = _inputs(1, tokens=4, dtype=dtype)
    slots, fresh = jnp.asarray([5, 0, 2, 7], jnp.int32), jnp.asarray([False, False, True, False])
    y_ref, pool_ref = causal_conv1d_decode_slots(x, w, b, pool, slots, fresh)
    y, new_pool = causal_conv1d_decode(x, w, b, jnp.array(pool, copy=True), slots, fresh, block_c=8, interpret=True)
    assert _rel(y, y_ref) <= tol
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32), np.asarray(pool_ref, np.float32))


def test_unsupported_shapes_fall_back_to_the_oracle():
    x, w, b, pool = _inputs(2, tokens=12, channels=6)  # 6 channels: no power-of-two block of >= 8
    assert not supported(x, w, pool, "silu")
    assert not supported(*_inputs(2, tokens=12)[0:2], _inputs(2, tokens=12)[3], "gelu")  # activation not fused
    meta = _meta([(0, 5, 1, False), (5, 7, 2, True)])
    y, _ = varlen_slots(x, w, b, pool, *meta, max_len=8)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(causal_conv1d_varlen_slots(x, w, b, pool, *meta, max_len=8)[0]))
    y, _ = decode_slots(x[:2], w, b, pool, meta[2], meta[3])
    np.testing.assert_array_equal(np.asarray(y), np.asarray(causal_conv1d_decode_slots(x[:2], w, b, pool, meta[2], meta[3])[0]))


def _lower(fn, *args, **kw):
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        text = fn.trace(*args, **kw).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()
    assert "input_output_alias" in text or "tf.aliasing_output" in text  # the pool is updated in place


@pytest.mark.parametrize("decode", [False, True])
def test_cross_lowers_for_cuda_at_production_shapes(decode):
    """8192 conv channels (Mamba, repeat before conv), K = 4, bf16; 8192 tokens in 8 sequences (prefill) or 256
    rows (decode); a pool of 257 slots."""
    S = jax.ShapeDtypeStruct
    bf, i32 = jnp.bfloat16, jnp.int32
    channels, taps, pool = 8192, 4, 257
    tokens, seqs = (256, 256) if decode else (8192, 8)
    args = [S((tokens, channels), bf), S((channels, taps), bf), S((channels,), bf), S((pool, taps - 1, channels), bf)]
    if decode:
        _lower(causal_conv1d_decode, *args, S((seqs,), i32), S((seqs,), jnp.bool_))
    else:
        _lower(causal_conv1d_varlen, *args, S((seqs,), i32), S((seqs,), i32), S((seqs,), i32), S((seqs,), jnp.bool_),
               max_len=2048)


def test_decode_kernel_reads_its_input_in_place_at_an_offset():
    """x_offset: the input is columns [offset, offset + C) of a wider buffer (a projection's output read in
    place), in the op and the kernel alike; an offset past the buffer is refused."""
    x, w, b, pool = _inputs(3, tokens=4, dtype=jnp.bfloat16)
    slots, fresh = jnp.asarray([5, 0, 2, 7], jnp.int32), jnp.asarray([False, False, True, False])
    wide = jnp.concatenate([jnp.ones((4, 8), x.dtype), x, -jnp.ones((4, 24), x.dtype)], axis=1)
    y_ref, pool_ref = causal_conv1d_decode_slots(x, w, b, pool, slots, fresh)
    y_op, pool_op = causal_conv1d_decode_slots(wide, w, b, pool, slots, fresh, x_offset=8)
    np.testing.assert_array_equal(np.asarray(y_op, np.float32), np.asarray(y_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(pool_op, np.float32), np.asarray(pool_ref, np.float32))
    y, new_pool = causal_conv1d_decode(wide, w, b, jnp.array(pool, copy=True), slots, fresh, x_offset=8, block_c=8,
                                       interpret=True)
    assert y.shape == x.shape and _rel(y, y_ref) <= 1e-2
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32), np.asarray(pool_ref, np.float32))
    with pytest.raises(ValueError, match="conv input"):
        causal_conv1d_decode_slots(wide, w, b, pool, slots, fresh, x_offset=wide.shape[1] - x.shape[1] + 1)


def test_decode_kernel_writes_over_its_input():
    """over_input: the conv of a wider buffer's first C columns comes back in that buffer, the columns after them
    untouched; the dispatch entry's fallback (the op and a concatenation) gives the same."""
    from pallas_kernels.causal_conv1d import decode_slots_over_input

    x, w, b, pool = _inputs(4, tokens=4, dtype=jnp.bfloat16)
    slots, fresh = jnp.asarray([5, 0, 2, 7], jnp.int32), jnp.asarray([False, False, True, False])
    tail = jnp.asarray(np.random.default_rng(4).standard_normal((4, 24)), x.dtype)
    wide = jnp.concatenate([x, tail], axis=1)
    y_ref, pool_ref = causal_conv1d_decode_slots(x, w, b, pool, slots, fresh)
    y, new_pool = causal_conv1d_decode(wide, w, b, jnp.array(pool, copy=True), slots, fresh, over_input=True,
                                       block_c=8, interpret=True)
    assert y.shape == wide.shape and _rel(y[:, :16], y_ref) <= 1e-2
    np.testing.assert_array_equal(np.asarray(y[:, 16:], np.float32), np.asarray(tail, np.float32))
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32), np.asarray(pool_ref, np.float32))
    narrow_w = w[:6]  # 6 channels: no kernel, the op's path
    y, _ = decode_slots_over_input(wide, narrow_w, None, pool[:, :, :6], slots, fresh)
    y_op, _ = causal_conv1d_decode_slots(wide[:, :6], narrow_w, None, pool[:, :, :6], slots, fresh)
    np.testing.assert_array_equal(np.asarray(y[:, :6], np.float32), np.asarray(y_op, np.float32))
    np.testing.assert_array_equal(np.asarray(y[:, 6:], np.float32), np.asarray(wide[:, 6:], np.float32))
