"""The dispatch point: registered kernels run behind one jit per call signature (lowered once per step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax import dispatch


def test_a_kernel_called_at_many_sites_is_traced_once_per_signature(monkeypatch):
    monkeypatch.setattr(dispatch, "_KERNELS", dict(dispatch._KERNELS))
    traces = []

    def kernel(x, norm_weight, eps, w_gate, w_up, act):
        traces.append((x.shape, eps, act))
        return dispatch._REFERENCE["norm_gated_mlp"](x, norm_weight, eps, w_gate, w_up, act)

    dispatch.register("norm_gated_mlp", "cpu", kernel)
    fn = dispatch.op("norm_gated_mlp")
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (2, 16))
    nw, wg, wu = (jax.random.normal(k, s) for k, s in zip(keys[1:], ((16,), (32, 16), (32, 16))))

    @jax.jit
    def layers(x):
        outs = []
        for _ in range(4):  # four call sites, one signature
            outs.append(fn(x, nw, 1e-6, wg, wu, "silu"))
            x = x + outs[-1][:, :16]
        outs.append(fn(x, nw, 1e-5, wg, wu, "silu"))  # another eps: another signature
        outs.append(fn(x[:1], nw, 1e-5, wg, wu, "silu"))  # another shape
        return outs

    got = layers(x)
    assert traces == [((2, 16), 1e-6, "silu"), ((2, 16), 1e-5, "silu"), ((1, 16), 1e-5, "silu")]
    reference = dispatch._REFERENCE["norm_gated_mlp"]
    np.testing.assert_allclose(got[0], reference(x, nw, 1e-6, wg, wu, "silu"), rtol=1e-5, atol=1e-5)
    layers(x)  # cached: no new trace
    assert len(traces) == 3


def test_a_kernel_with_an_unhashable_argument_is_called_directly(monkeypatch):
    monkeypatch.setattr(dispatch, "_KERNELS", dict(dispatch._KERNELS))
    seen = []

    def kernel(q, k_pages, v_pages, block_table, first_page, q_positions, window=None):
        seen.append(window)
        return q + 1

    dispatch.register("paged_attention", "cpu", kernel)
    fn, q = dispatch.op("paged_attention"), jnp.ones((1, 1, 2, 4))
    for _ in range(2):
        np.testing.assert_array_equal(fn(q, q, q, q, q, q, 8), q + 1)
    assert seen == [8]  # hashable: jitted, traced once
    for _ in range(2):
        np.testing.assert_array_equal(fn(q, q, q, q, q, q, [{1}]), q + 1)  # a set leaf cannot be hashed
    assert seen == [8, [{1}], [{1}]]


def test_registering_an_unknown_op_names_the_known_ones():
    with pytest.raises(KeyError, match="known ops"):
        dispatch.register("no_such_op", "cpu", lambda x: x)


def test_equal_arguments_of_other_types_are_other_signatures():
    kernel = dispatch.lowered_once(lambda x, scale: x * scale)
    x = jnp.arange(4, dtype=jnp.int32)
    assert kernel(x, 2).dtype == jnp.int32
    assert kernel(x, 2.0).dtype == (x * 2.0).dtype  # 2 == 2.0, but a float scale makes a float product
