"""Mamba selective-scan kernels (varlen prefill and decode over the slot pool): interpret mode against the jnp
oracles on CPU, and cross-lowering for CUDA at production shapes (Triton power-of-two and layout rules)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops.mamba import selective_scan_decode_slots, selective_scan_varlen_slots
from pallas_kernels.selective_scan import (
    decode_slots,
    fill_ranges,
    selective_scan_decode,
    selective_scan_varlen,
    supported,
    varlen_slots,
)

# (start, length, slot, fresh): packed with a gap, out-of-order slots, lengths 0 and 1, odd lengths, a fresh row.
SEQS = [(30, 9, 3, False), (2, 7, 5, False), (9, 1, 2, False), (10, 0, 0, False), (12, 13, 6, True), (25, 2, 1, False)]
N_TOKENS, N_SLOTS, MAX_LEN = 41, 8, 16


def _meta(seqs=SEQS):
    starts, lengths, slots, fresh = (np.asarray(c) for c in zip(*seqs))
    return dict(starts=jnp.asarray(starts, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32),
                slots=jnp.asarray(slots, jnp.int32), fresh=jnp.asarray(fresh))


def _inputs(seed, tokens=N_TOKENS, channels=32, state=4, groups=2, dtype=jnp.float32, dt_bias=True):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    return dict(
        u=f(tokens, channels), delta=f(tokens, channels),
        A_log=jnp.asarray(np.log(rng.uniform(0.5, 4.0, (channels, state))), jnp.float32),
        B=f(tokens, groups, state), C=f(tokens, channels // state, state), D=jnp.asarray(rng.standard_normal(channels), jnp.float32),
        z=f(tokens, channels), dt_bias=f(channels) if dt_bias else None,
        state_pool=jnp.asarray(rng.standard_normal((N_SLOTS, channels, state)), jnp.float32),
    )


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _copy(x):
    return dict(x, state_pool=jnp.array(x["state_pool"], copy=True))  # the kernel donates the pool


@pytest.mark.parametrize("dtype, tol, hp, dt_bias, segments", [
    (jnp.float32, 1e-5, 1, True, 1), (jnp.float32, 1e-5, 4, False, 1), (jnp.bfloat16, 1e-2, 2, True, 1),
    # time-segmented: more parts than some sequences have tokens (empty parts), and parts of uneven length
    (jnp.float32, 1e-5, 2, True, 4), (jnp.bfloat16, 1e-2, 1, False, 3),
])
def test_varlen_kernel_matches_oracle(dtype, tol, hp, dt_bias, segments):
    x, meta = _inputs(0, dtype=dtype, dt_bias=dt_bias), _meta()
    y_ref, pool_ref = selective_scan_varlen_slots(**x, **meta, max_len=MAX_LEN)
    y, pool = selective_scan_varlen(**_copy(x), **meta, max_len=MAX_LEN, heads_per_program=hp, segments=segments,
                                    interpret=True)
    assert y.dtype == dtype and pool.dtype == jnp.float32
    covered = np.zeros(N_TOKENS, bool)
    for start, length, *_ in SEQS:
        covered[start:start + length] = True
    y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
    assert _rel(y[covered], y_ref[covered]) <= tol
    assert np.all(y[~covered] == 0)  # zero-filled, not left uninitialised
    written = sorted({s[2] for s in SEQS if s[1] > 0})
    assert _rel(np.asarray(pool)[written], np.asarray(pool_ref)[written]) <= 1e-5
    untouched = np.setdiff1d(np.arange(N_SLOTS), written)  # incl. the sink slot of the empty row
    np.testing.assert_array_equal(np.asarray(pool)[untouched], np.asarray(x["state_pool"])[untouched])


def test_fill_ranges_cover_the_buffer_exactly_once():
    meta = _meta(SEQS + [(12, 0, 0, False)])  # a second sequence at start 12: only the longer one fills
    pre, hi = (np.asarray(a) for a in fill_ranges(meta["starts"], meta["lengths"], N_TOKENS))
    count = np.zeros(N_TOKENS, int)
    for (start, length, *_), p, h in zip(SEQS + [(12, 0, 0, False)], pre, hi):
        count[p:start] += 1
        count[start:start + length] += 1
        count[start + length:h] += 1
    np.testing.assert_array_equal(count, 1)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_decode_kernel_matches_oracle(dtype, tol):
    x = _inputs(1, tokens=4, dtype=dtype)
    slots, fresh = jnp.asarray([5, 0, 2, 7], jnp.int32), jnp.asarray([False, False, True, False])
    y_ref, pool_ref = selective_scan_decode_slots(**x, slots=slots, fresh=fresh)
    y, pool = selective_scan_decode(**_copy(x), slots=slots, fresh=fresh, heads_per_program=2, interpret=True)
    assert _rel(y, y_ref) <= tol and _rel(pool, pool_ref) <= 1e-5
    np.testing.assert_array_equal(np.asarray(pool)[[1, 3, 4, 6]], np.asarray(x["state_pool"])[[1, 3, 4, 6]])


def test_unsupported_shapes_fall_back_to_the_oracle():
    x = _inputs(2, tokens=12, channels=24, state=3, groups=2)  # N = 3 is not a power of two
    assert not supported(x["u"], x["A_log"], x["B"], x["C"], x["state_pool"])
    meta = _meta([(0, 5, 1, False), (5, 7, 2, True)])
    y, pool = varlen_slots(**x, **meta, max_len=8)
    y_ref, pool_ref = selective_scan_varlen_slots(**x, **meta, max_len=8)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    step = {k: (v[:2] if k in ("u", "delta", "B", "C", "z") else v) for k, v in x.items()}
    y, _ = decode_slots(**step, slots=meta["slots"], fresh=meta["fresh"])
    np.testing.assert_array_equal(np.asarray(y), np.asarray(selective_scan_decode_slots(**step, slots=meta["slots"], fresh=meta["fresh"])[0]))


def _lower(fn, *args, **kw):
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        text = fn.trace(*args, **kw).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()
    assert "input_output_alias" in text or "tf.aliasing_output" in text  # the pool is updated in place


@pytest.mark.parametrize("decode", [False, True])
def test_cross_lowers_for_cuda_at_production_shapes(decode):
    """d_inner 4096, d_xb 1024 (64 groups of N = 16), bf16 operands; 8192 tokens in 8 sequences (prefill) or 256
    rows (decode); a pool of 257 slots."""
    S = jax.ShapeDtypeStruct
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    din, n, groups, pool = 4096, 16, 64, 257
    tokens, seqs = (256, 256) if decode else (8192, 8)
    args = [S((tokens, din), bf), S((tokens, din), bf), S((din, n), f32), S((tokens, groups, n), bf),
            S((tokens, din // n, n), bf), S((din,), f32), S((tokens, din), bf), S((din,), bf), S((pool, din, n), f32)]
    if decode:
        _lower(selective_scan_decode, *args, S((seqs,), i32), S((seqs,), jnp.bool_))
    else:
        for hp, segments in ((1, 1), (4, 1), (1, 32)):
            _lower(selective_scan_varlen, *args, S((seqs,), i32), S((seqs,), i32), S((seqs,), i32),
                   S((seqs,), jnp.bool_), max_len=2048, heads_per_program=hp, segments=segments)


def test_segment_rule_bounds_memory_and_segment_length():
    """The dispatch's time segments: many for one long sequence, none for short or many sequences, and the
    per-part states (rows x segments x Din x N) never above the measured bound."""
    from pallas_kernels.selective_scan import _segments

    assert _segments(1, 8192, 4096, 16) == 32
    assert _segments(8, 2048, 4096, 16) == 32  # 64 tokens per segment
    assert _segments(8, 1024, 4096, 16) == 16
    assert _segments(1, 100, 4096, 16) == 1
    assert _segments(256, 8192, 4096, 16) == 1
    assert _segments(1, None, 4096, 16) == 1
    for rows in (1, 3, 8, 64):
        for din in (1024, 4096, 8192):
            p = _segments(rows, 1 << 16, din, 16)
            assert 1 <= p <= 32 and (p == 1 or rows * p * din * 16 <= 256 * 4096 * 16)
