import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops import delta_rule as dr
from tests.ops.util import RTOL, rel_err, split_points


def _gdn_inputs(seed, batch=2, length=29, key_heads=2, value_heads=4, key_dim=8, value_dim=6):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return dict(
        q=f(batch, length, key_heads, key_dim),
        k=f(batch, length, key_heads, key_dim),
        v=f(batch, length, value_heads, value_dim),
        g=-jnp.asarray(rng.uniform(0.0, 2.0, (batch, length, value_heads)), jnp.float32),
        beta=jnp.asarray(rng.uniform(0.0, 1.0, (batch, length, value_heads)), jnp.float32),
        initial_state=f(batch, value_heads, key_dim, value_dim),
    )


def _kda_inputs(seed, batch=2, length=29, heads=3, dim=8):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return dict(
        q=f(batch, length, heads, dim),
        k=f(batch, length, heads, dim),
        v=f(batch, length, heads, dim),
        # Strong decays too: KDA has no lower bound on g in Apriel2 configs.
        g=-jnp.asarray(rng.uniform(0.0, 6.0, (batch, length, heads, dim)), jnp.float32),
        beta=jnp.asarray(rng.uniform(0.0, 1.0, (batch, length, heads)), jnp.float32),
        initial_state=f(batch, heads, dim, dim),
    )


CASES = {
    "gdn": (_gdn_inputs, dr.gated_delta_rule, dr.gated_delta_rule_step),
    "gdn_equal_heads": (lambda s: _gdn_inputs(s, key_heads=3, value_heads=3, key_dim=4, value_dim=4), dr.gated_delta_rule, dr.gated_delta_rule_step),
    "kda": (_kda_inputs, dr.kda_delta_rule, dr.kda_delta_rule_step),
}


@pytest.mark.parametrize("name", CASES)
def test_sequence_form_equals_token_by_token_steps(name):
    make, seq, step = CASES[name]
    x = make(0)
    out, final = seq(**x)
    state, outs = x["initial_state"], []
    for t in range(x["q"].shape[1]):
        o, state = step(x["q"][:, t], x["k"][:, t], x["v"][:, t], x["g"][:, t], x["beta"][:, t], state)
        outs.append(o)
    assert rel_err(out, jnp.stack(outs, 1)) <= RTOL
    assert rel_err(final, state) <= RTOL


@pytest.mark.parametrize("name", CASES)
def test_prefill_in_pieces_equals_whole(name):
    make, seq, _ = CASES[name]
    x = make(1)
    whole, whole_state = seq(**x)
    bounds = split_points(x["q"].shape[1])
    state, pieces = x["initial_state"], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        part = {k: v[:, a:b] for k, v in x.items() if k != "initial_state"}
        o, state = seq(**part, initial_state=state)
        pieces.append(o)
    assert bounds[1:4] == [1, 4, 11]
    assert rel_err(jnp.concatenate(pieces, 1), whole) <= RTOL
    assert rel_err(state, whole_state) <= RTOL


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunk_size_does_not_change_the_result(name, chunk):
    make, seq, _ = CASES[name]
    x = make(2)
    ref, ref_state = seq(**x, chunk_size=8)
    out, state = seq(**x, chunk_size=chunk)
    assert rel_err(out, ref) <= RTOL and rel_err(state, ref_state) <= RTOL


def test_zero_decay_and_beta_are_identity_updates():
    x = _gdn_inputs(3, length=5)
    x["beta"] = jnp.zeros_like(x["beta"])
    x["g"] = jnp.zeros_like(x["g"])
    _, final = dr.gated_delta_rule(**x)
    np.testing.assert_array_equal(np.asarray(final), np.asarray(x["initial_state"]))


def test_gates():
    a = jnp.asarray([[-30.0, 0.0, 25.0]])
    g = dr.gdn_gate(a, jnp.log(jnp.asarray([0.5, 1.0, 2.0])), jnp.zeros(3))
    expected = -np.array([0.5, 1.0, 2.0]) * np.array([np.log1p(np.exp(-30.0)), np.log(2.0), 25.0])
    np.testing.assert_allclose(np.asarray(g)[0], expected, rtol=1e-6)
    raw = jnp.ones((1, 2, 3))
    kg = dr.kda_gate(raw, jnp.log(jnp.asarray([1.0, 3.0])), jnp.arange(6, dtype=jnp.float32))
    bias = np.arange(6).reshape(2, 3)
    np.testing.assert_allclose(np.asarray(kg)[0], -np.array([[1.0], [3.0]]) * np.log1p(np.exp(1.0 + bias)), rtol=1e-6)
