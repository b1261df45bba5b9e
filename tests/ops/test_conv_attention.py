import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops.attention import attention
from apriel2_jax.ops.conv import causal_conv1d, causal_conv1d_step
from apriel2_jax.ops.rope import apply_rope, rope_cos_sin
from tests.ops.util import RTOL, rel_err, split_points


def _conv_inputs(seed, batch=2, length=19, channels=6, kernel=4):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return f(batch, length, channels), f(channels, kernel), f(channels), f(batch, kernel - 1, channels)


@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_sequence_equals_steps_and_pieces(with_bias):
    x, w, b, s0 = _conv_inputs(0)
    b = b if with_bias else None
    y, final = causal_conv1d(x, w, b, s0)
    state, outs = s0, []
    for t in range(x.shape[1]):
        o, state = causal_conv1d_step(x[:, t], w, b, state)
        outs.append(o)
    assert rel_err(y, jnp.stack(outs, 1)) <= RTOL and rel_err(final, state) <= RTOL
    state, pieces = s0, []
    bounds = split_points(x.shape[1])
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        o, state = causal_conv1d(x[:, lo:hi], w, b, state)
        pieces.append(o)
    assert rel_err(jnp.concatenate(pieces, 1), y) <= RTOL
    np.testing.assert_array_equal(np.asarray(state), np.asarray(final))
    # The state is the last K-1 raw inputs.
    np.testing.assert_array_equal(np.asarray(final), np.asarray(x[:, -3:]))


def _dense_attention(q, k, v, window):
    """Per-head numpy attention with an explicit mask: the oracle for GQA and windows."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    batch, length, heads, dim = q.shape
    rep = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            s = q[b, :, h] @ k[b, :, h // rep].T / np.sqrt(dim)
            t = np.arange(length)
            mask = t[None, :] <= t[:, None]
            if window is not None:
                mask &= t[None, :] > t[:, None] - window
            s = np.where(mask, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v[b, :, h // rep]
    return out


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 1), (6, 2)])
@pytest.mark.parametrize("window", [None, 1, 4, 100])
def test_attention_masks_and_gqa(heads, groups, window):
    rng = np.random.default_rng(heads * 10 + groups)
    batch, length, dim = 2, 11, 8
    q = jnp.asarray(rng.standard_normal((batch, length, heads, dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, length, groups, dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, length, groups, dim)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(length), (batch, length))
    out = attention(q, k, v, pos, pos, None, window)
    assert rel_err(out, _dense_attention(q, k, v, window)) <= RTOL


def test_attention_ignores_invalid_slots_and_respects_positions():
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((1, 2, 2, 4)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 5, 1, 4)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 5, 1, 4)), jnp.float32)
    # Keys stored out of order; one slot invalid. Queries at positions 3 and 4.
    kv_pos = jnp.asarray([[4, 0, 3, 1, 2]])
    valid = jnp.asarray([[True, True, True, True, False]])
    out = attention(q, k, v, jnp.asarray([[3, 4]]), kv_pos, valid, None)
    order = np.array([1, 3, 2, 0])  # positions 0, 1, 3, 4 (position 2 is invalid)
    ref_k, ref_v = np.asarray(k)[:, order], np.asarray(v)[:, order]
    s = np.einsum("hd,sd->hs", np.asarray(q)[0, 1], ref_k[0, :, 0]) / 2.0
    p = np.exp(s - s.max(-1, keepdims=True))
    expected = (p / p.sum(-1, keepdims=True)) @ ref_v[0, :, 0]
    assert rel_err(np.asarray(out)[0, 1], expected) <= RTOL


def test_rope_rotates_pairs_of_halves():
    pos = jnp.asarray([[0, 1, 7]])
    cos, sin = rope_cos_sin(pos, 4, 100.0, jnp.float32)
    x = jnp.ones((1, 3, 1, 4))
    y = np.asarray(apply_rope(x, cos, sin))[0, :, 0]
    np.testing.assert_allclose(y[0], [1, 1, 1, 1], rtol=1e-6)
    inv = np.array([1.0, 100.0 ** -0.5])
    for i, p in enumerate([0, 1, 7]):
        ang = p * inv
        np.testing.assert_allclose(y[i, :2], np.cos(ang) - np.sin(ang), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y[i, 2:], np.cos(ang) + np.sin(ang), rtol=1e-5, atol=1e-6)
