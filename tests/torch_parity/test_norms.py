"""Block RMSNorm and the GDN/KDA gated RMSNorm vs transformers (MistralRMSNorm, Qwen3NextRMSNormGated,
KimiLinearRMSNormGated) and fla's pure-torch references (rms_norm_ref, gated rms_norm_ref)."""

import numpy as np
import pytest
import torch
from fla.modules.norm.layernorm import rms_norm_ref
from fla.modules.norm.layernorm_gated import rms_norm_ref as gated_rms_norm_ref
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

from apriel2_jax.ops.norms import gated_rms_norm, rms_norm

from .helpers import assert_close, rng, to_jnp, to_torch

EPS = 1e-5


def inputs(seed, n=24):
    r = rng(seed)
    x = r.normal(scale=3.0, size=(2, 13, 3, n)).astype(np.float32)
    gate = r.normal(scale=2.0, size=x.shape).astype(np.float32)
    weight = r.normal(size=n).astype(np.float32)
    return x, gate, weight


def with_weight(module, weight):
    with torch.no_grad():
        module.weight.copy_(to_torch(weight))
    return module


def test_rms_norm_vs_mistral_and_fla():
    x, _, w = inputs(0)
    ours = rms_norm(to_jnp(x), to_jnp(w), EPS)
    with torch.no_grad():
        ref = with_weight(MistralRMSNorm(w.size, eps=EPS), w)(to_torch(x))
    assert_close("rms_norm vs mistral MistralRMSNorm", ours, ref)
    assert_close("rms_norm vs fla rms_norm_ref", ours, rms_norm_ref(to_torch(x), to_torch(w), None, eps=EPS))


@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_gated_rms_norm_vs_hf_and_fla(act):
    x, gate, w = inputs(1)
    ours = gated_rms_norm(to_jnp(x), to_jnp(gate), to_jnp(w), EPS, act)
    with torch.no_grad():
        module = Qwen3NextRMSNormGated(w.size, eps=EPS) if act == "silu" else KimiLinearRMSNormGated(w.size, eps=EPS)
        assert module.activation == act
        ref = with_weight(module, w)(to_torch(x), to_torch(gate))
    assert_close(f"gated_rms_norm act={act} vs {type(module).__name__}", ours, ref)
    if act == "silu":
        fla_ref = gated_rms_norm_ref(to_torch(x), to_torch(w), None, z=to_torch(gate), eps=EPS, norm_before_gate=True)
        assert_close("gated_rms_norm act=silu vs fla layernorm_gated.rms_norm_ref", ours, fla_ref)
