"""Decoder-block helpers of ``apriel2_jax.modules.model``."""

import jax
import jax.numpy as jnp
import numpy as np

from apriel2_jax.modules.model import normalized_once


def _primitives(fn, x):
    return {e.primitive.name for e in jax.make_jaxpr(fn)(x).eqns}


def test_normalized_once_is_a_barrier_for_multi_token_inputs_only():
    """Prefill (several tokens per row) gets one optimisation barrier, so XLA materialises the norm once for all
    its projections; decode (one token per row) is left to XLA's fusions. Values pass through unchanged."""
    prefill = jnp.arange(2 * 5 * 8, dtype=jnp.float32).reshape(2, 5, 8)
    decode = prefill[:, :1]
    assert "optimization_barrier" in _primitives(normalized_once, prefill)
    assert "optimization_barrier" not in _primitives(normalized_once, decode)
    np.testing.assert_array_equal(np.asarray(jax.jit(normalized_once)(prefill)), np.asarray(prefill))
