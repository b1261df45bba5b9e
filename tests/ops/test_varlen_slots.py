"""Slot-pool varlen/decode oracles (the engine layout) against the plain sequence/step ops run per sequence."""

import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops.conv import (
    causal_conv1d,
    causal_conv1d_decode_slots,
    causal_conv1d_step,
    causal_conv1d_varlen_slots,
)
from apriel2_jax.ops.mamba import (
    selective_scan,
    selective_scan_decode_slots,
    selective_scan_step,
    selective_scan_varlen_slots,
)
from tests.ops.util import RTOL, rel_err

# Packed sequences (start, length, slot, fresh) in a 40-token buffer, with gaps, a 0- and a 1-token sequence.
SEQS = [(0, 7, 4, False), (9, 1, 2, False), (10, 0, 0, False), (12, 13, 6, True), (25, 2, 1, False), (30, 9, 3, False)]
N_TOKENS, N_SLOTS, MAX_LEN = 40, 8, 16


def _meta():
    starts, lengths, slots, fresh = (np.asarray(c) for c in zip(*SEQS))
    return (jnp.asarray(starts, jnp.int32), jnp.asarray(lengths, jnp.int32), jnp.asarray(slots, jnp.int32),
            jnp.asarray(fresh))


def _scan_inputs(seed, channels=24, state=4, groups=2):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return dict(
        u=f(N_TOKENS, channels), delta=f(N_TOKENS, channels),
        A_log=jnp.asarray(np.log(rng.uniform(0.5, 4.0, (channels, state))), jnp.float32),
        B=f(N_TOKENS, groups, state), C=f(N_TOKENS, channels // state, state), D=f(channels),
        z=f(N_TOKENS, channels), dt_bias=f(channels),
    ), f(N_SLOTS, channels, state)


def test_scan_varlen_slots_equals_per_sequence_scans():
    x, pool = _scan_inputs(0)
    y, new_pool = selective_scan_varlen_slots(**x, state_pool=pool, starts=_meta()[0], lengths=_meta()[1],
                                              slots=_meta()[2], fresh=_meta()[3], max_len=MAX_LEN)
    y, new_pool = np.asarray(y), np.asarray(new_pool)
    covered = np.zeros(N_TOKENS, bool)
    for start, length, slot, fresh in SEQS:
        if length == 0:
            continue
        part = {k: (v[None, start:start + length] if k in ("u", "delta", "B", "C", "z") else v) for k, v in x.items()}
        init = jnp.zeros_like(pool[slot]) if fresh else pool[slot]
        ref_y, ref_state = selective_scan(**part, initial_state=init[None])
        assert rel_err(y[start:start + length], ref_y[0]) <= RTOL
        assert rel_err(new_pool[slot], ref_state[0]) <= RTOL
        covered[start:start + length] = True
    assert np.all(y[~covered] == 0)
    untouched = np.setdiff1d(np.arange(N_SLOTS), [s[2] for s in SEQS if s[1] > 0])
    np.testing.assert_array_equal(new_pool[untouched], np.asarray(pool)[untouched])


def test_scan_decode_slots_equals_steps():
    x, pool = _scan_inputs(1)
    rows = 4
    slots, fresh = jnp.asarray([5, 0, 2, 7], jnp.int32), jnp.asarray([False, False, True, False])
    step = {k: (v[:rows] if k in ("u", "delta", "B", "C", "z") else v) for k, v in x.items()}
    y, new_pool = selective_scan_decode_slots(**step, state_pool=pool, slots=slots, fresh=fresh)
    init = jnp.where(fresh[:, None, None], 0.0, pool[slots])
    ref_y, ref_rows = selective_scan_step(**step, state=init)
    assert rel_err(y, ref_y) <= RTOL and rel_err(new_pool[slots], ref_rows) <= RTOL
    np.testing.assert_array_equal(np.asarray(new_pool)[[1, 3, 4, 6]], np.asarray(pool)[[1, 3, 4, 6]])


def _conv_inputs(seed, channels=6, kernel=4):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return f(N_TOKENS, channels), f(channels, kernel), f(channels), f(N_SLOTS, kernel - 1, channels)


def test_conv_varlen_slots_equals_per_sequence_convs():
    x, w, b, pool = _conv_inputs(2)
    starts, lengths, slots, fresh = _meta()
    y, new_pool = causal_conv1d_varlen_slots(x, w, b, pool, starts, lengths, slots, fresh, max_len=MAX_LEN)
    y, new_pool = np.asarray(y), np.asarray(new_pool)
    covered = np.zeros(N_TOKENS, bool)
    for start, length, slot, is_fresh in SEQS:
        if length == 0:
            continue
        init = jnp.zeros_like(pool[slot]) if is_fresh else pool[slot]
        ref_y, ref_state = causal_conv1d(x[None, start:start + length], w, b, init[None])
        assert rel_err(y[start:start + length], ref_y[0]) <= RTOL
        # The new state: the last K-1 inputs, older state inputs included for a 1- or 2-token sequence.
        np.testing.assert_array_equal(new_pool[slot], np.asarray(ref_state[0]))
        covered[start:start + length] = True
    assert np.all(y[~covered] == 0)
    np.testing.assert_array_equal(new_pool[[0, 5, 7]], np.asarray(pool)[[0, 5, 7]])


def test_conv_decode_slots_equals_steps():
    x, w, b, pool = _conv_inputs(3)
    slots, fresh = jnp.asarray([3, 0, 6], jnp.int32), jnp.asarray([False, True, False])
    y, new_pool = causal_conv1d_decode_slots(x[:3], w, b, pool, slots, fresh)
    init = jnp.where(fresh[:, None, None], 0.0, pool[slots])
    ref_y, ref_rows = causal_conv1d_step(x[:3], w, b, init)
    assert rel_err(y, ref_y) <= RTOL
    np.testing.assert_array_equal(np.asarray(new_pool[slots]), np.asarray(ref_rows))
    np.testing.assert_array_equal(np.asarray(new_pool)[[1, 2, 4, 5, 7]], np.asarray(pool)[[1, 2, 4, 5, 7]])


@pytest.mark.parametrize("kda", [False, True])
def test_delta_rule_varlen_slots_equals_each_sequence_alone(kda):
    from apriel2_jax.ops.delta_rule import delta_rule_varlen_slots, gated_delta_rule, kda_delta_rule

    rng = np.random.default_rng(7)
    heads, key_heads, dim, tokens = 2, 2 if kda else 1, 8, 30
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k, v = f(tokens, key_heads, dim), f(tokens, key_heads, dim), f(tokens, heads, dim)
    g = -jnp.asarray(rng.uniform(0, 1, (tokens, heads, dim) if kda else (tokens, heads)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (tokens, heads)), jnp.float32)
    pool = f(4, heads, dim, dim)
    starts, lengths, slots = [0, 11, 12], [11, 1, 15], [2, 0, 3]
    fresh = [False, True, False]
    o, new_pool = delta_rule_varlen_slots(q, k, v, g, beta, pool, jnp.asarray(starts), jnp.asarray(lengths),
                                          jnp.asarray(slots), jnp.asarray(fresh), max_len=16)
    fn = kda_delta_rule if kda else gated_delta_rule
    for s, n, slot, new in zip(starts, lengths, slots, fresh):
        init = jnp.zeros_like(pool[slot]) if new else pool[slot]
        piece = lambda a: a[None, s:s + n]  # noqa: E731
        o_one, state = fn(piece(q), piece(k), piece(v), piece(g), piece(beta), init[None])
        np.testing.assert_allclose(np.asarray(o[s:s + n]), np.asarray(o_one[0]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(new_pool[slot]), np.asarray(state[0]), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(o[27:]))  # tokens outside every sequence
    np.testing.assert_array_equal(np.asarray(new_pool[1]), np.asarray(pool[1]))
