"""The MLP's activations vs transformers' ``ACT2FN``, in float32 and bf16 (spec §1.3: HF takes the MLP's
``activation`` from that table)."""

import numpy as np
import pytest
import torch
from transformers.activations import ACT2FN

import jax.numpy as jnp

from apriel2_jax.config import _ACTIVATIONS
from apriel2_jax.ops.norms import _ACTIVATIONS as COMPUTED, activation


def test_config_accepts_exactly_the_computed_activations():
    assert sorted(_ACTIVATIONS) == sorted(COMPUTED)
    assert set(_ACTIVATIONS) <= set(ACT2FN)
    assert set(ACT2FN) - set(_ACTIVATIONS) <= {"prelu", "xielu"}, "a new parameter-free ACT2FN entry"


@pytest.mark.parametrize("name", sorted(COMPUTED))
def test_activation_matches_act2fn(name):
    x = np.concatenate([np.linspace(-30, 30, 2001), np.random.default_rng(0).normal(scale=4, size=2000)])
    x = x.astype(np.float32)
    with torch.no_grad():
        ref = ACT2FN[name](torch.from_numpy(x)).numpy()
    ours = np.asarray(activation(name, jnp.asarray(x)))
    np.testing.assert_allclose(ours, ref, rtol=2e-6, atol=2e-6, err_msg=name)
    # bf16: computed in float32 and rounded once, so within one bf16 rounding of the float32 reference.
    ours16 = np.asarray(activation(name, jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32))
    with torch.no_grad():
        ref16 = ACT2FN[name](torch.from_numpy(x).to(torch.bfloat16).float()).numpy()
    np.testing.assert_allclose(ours16, ref16, rtol=2 ** -7, atol=1e-6, err_msg=name)
