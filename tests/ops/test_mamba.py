import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops.mamba import selective_scan, selective_scan_step
from tests.ops.util import RTOL, rel_err, split_points


def _inputs(seed, batch=2, length=23, channels=24, state=4, groups=2):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    heads = channels // state
    return dict(
        u=f(batch, length, channels),
        delta=f(batch, length, channels),
        A_log=jnp.asarray(np.log(rng.uniform(0.5, 4.0, (channels, state))), jnp.float32),
        B=f(batch, length, groups, state),
        C=f(batch, length, heads, state),
        D=f(channels),
        z=f(batch, length, channels),
        dt_bias=f(channels),
        initial_state=f(batch, channels, state),
    )


_PER_TOKEN = ("u", "delta", "B", "C", "z")


def test_sequence_form_equals_steps():
    x = _inputs(0)
    y, final = selective_scan(**x)
    state, outs = x["initial_state"], []
    for t in range(x["u"].shape[1]):
        step_args = {k: (v[:, t] if k in _PER_TOKEN else v) for k, v in x.items() if k != "initial_state"}
        o, state = selective_scan_step(**step_args, state=state)
        outs.append(o)
    assert rel_err(y, jnp.stack(outs, 1)) <= RTOL
    assert rel_err(final, state) <= RTOL


def test_prefill_in_pieces_equals_whole():
    x = _inputs(1)
    whole, whole_state = selective_scan(**x)
    state, pieces = x["initial_state"], []
    bounds = split_points(x["u"].shape[1])
    for a, b in zip(bounds[:-1], bounds[1:]):
        part = {k: (v[:, a:b] if k in _PER_TOKEN else v) for k, v in x.items() if k != "initial_state"}
        o, state = selective_scan(**part, initial_state=state)
        pieces.append(o)
    assert rel_err(jnp.concatenate(pieces, 1), whole) <= RTOL
    assert rel_err(state, whole_state) <= RTOL


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_chunk_size_does_not_change_the_result(chunk):
    x = _inputs(2)
    ref, ref_state = selective_scan(**x, chunk_size=7)
    y, state = selective_scan(**x, chunk_size=chunk)
    assert rel_err(y, ref) <= RTOL and rel_err(state, ref_state) <= RTOL


def test_group_expansion_matches_explicit_loop():
    """Channel c (head c // N) reads B of group (c // N) // (heads / groups) and C of head c // N."""
    x = _inputs(3, batch=1, length=1, channels=24, state=4, groups=2)
    y, _ = selective_scan(**x)
    u, dt = np.asarray(x["u"])[0, 0], np.asarray(x["delta"])[0, 0] + np.asarray(x["dt_bias"])
    dt = np.log1p(np.exp(dt))
    A = -np.exp(np.asarray(x["A_log"]))
    s0 = np.asarray(x["initial_state"])[0]
    B, C = np.asarray(x["B"])[0, 0], np.asarray(x["C"])[0, 0]
    expected = np.zeros(24)
    for c in range(24):
        head = c // 4
        s = np.exp(dt[c] * A[c]) * s0[c] + dt[c] * u[c] * B[head // 3]
        expected[c] = s @ C[head] + np.asarray(x["D"])[c] * u[c]
    z = np.asarray(x["z"])[0, 0]
    expected *= z / (1 + np.exp(-z))
    assert rel_err(np.asarray(y)[0, 0], expected) <= RTOL
