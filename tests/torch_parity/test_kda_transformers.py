"""KDA vs transformers' Kimi-Linear pure-torch fallbacks (chunk_kimi_delta_attention,
recurrent_kimi_delta_attention) and its forget gate (KimiLinearForgetGate).

The Kimi functions take raw q/k with use_qk_l2norm_in_kernel=True and one q/k head per value head, so key heads
are expanded on the torch side for H_v = 2 H_k."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as kimi

from apriel2_jax.ops.delta_rule import kda_gate

from .helpers import assert_close, delta_inputs, ours_seq, ours_steps, rng, to_jnp, torch_fallback, torch_inputs

chunk_kimi_delta_attention = torch_fallback(kimi.chunk_kimi_delta_attention)
recurrent_kimi_delta_attention = torch_fallback(kimi.recurrent_kimi_delta_attention)

KDA_CASES = [(2, 2, 16), (2, 4, 5)]  # (H_k, H_v, our chunk size)


def hf(fn, inp, **kw):
    t = torch_inputs(inp, normalise=False, expand=True)
    return fn(
        t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["s0"], output_final_state=True,
        use_qk_l2norm_in_kernel=True, **kw,
    )


@pytest.mark.parametrize("h_k,h_v,chunk", KDA_CASES)
@pytest.mark.parametrize("hf_chunk", [64, 16])
def test_kda_vs_torch_chunk(h_k, h_v, chunk, hf_chunk):
    """T=37: one padded 64-chunk, or three padded 16-chunks, on the HF side."""
    inp = delta_inputs(100 + h_v, 37, h_k, h_v, 16, 16, kda=True)
    ref_o, ref_s = hf(chunk_kimi_delta_attention, inp, chunk_size=hf_chunk)
    o, s = ours_seq(inp, chunk, kda=True)
    name = f"kda seq chunk={chunk} Hk={h_k} Hv={h_v} vs kimi chunk_kimi_delta_attention(chunk={hf_chunk})"
    assert_close(name + ": o", o, ref_o)
    assert_close(name + ": state", s, ref_s)


def test_kda_vs_torch_chunk_multi_chunk():
    """T=100: two HF chunks of 64 (28 padding tokens)."""
    inp = delta_inputs(7, 100, 2, 2, 16, 16, kda=True)
    ref_o, ref_s = hf(chunk_kimi_delta_attention, inp)
    o, s = ours_seq(inp, 16, kda=True)
    assert_close("kda seq chunk=16 T=100 vs kimi chunk_kimi_delta_attention(chunk=64): o", o, ref_o)
    assert_close("kda seq chunk=16 T=100 vs kimi chunk_kimi_delta_attention(chunk=64): state", s, ref_s)


@pytest.mark.parametrize("h_k,h_v,chunk", KDA_CASES)
def test_kda_vs_torch_recurrent(h_k, h_v, chunk):
    inp = delta_inputs(100 + h_v, 37, h_k, h_v, 16, 16, kda=True)
    ref_o, ref_s = hf(recurrent_kimi_delta_attention, inp)
    for name, (o, s) in [(f"seq chunk={chunk}", ours_seq(inp, chunk, kda=True)), ("step", ours_steps(inp, kda=True))]:
        assert_close(f"kda {name} Hk={h_k} Hv={h_v} vs kimi recurrent_kimi_delta_attention: o", o, ref_o)
        assert_close(f"kda {name} Hk={h_k} Hv={h_v} vs kimi recurrent_kimi_delta_attention: state", s, ref_s)


def test_kda_gate_vs_kimi_forget_gate():
    """KimiLinearForgetGate: A_log [1,1,H,1], dt_bias [H*D]; ours gets the same pre-activation f_b(f_a(x))."""
    H, D, hidden = 3, 8, 32
    gate = kimi.KimiLinearForgetGate(SimpleNamespace(linear_head_dim=D, linear_num_heads=H, hidden_size=hidden))
    r = rng(9)
    with torch.no_grad():
        for p in gate.parameters():
            p.copy_(torch.from_numpy(r.normal(size=p.shape).astype(np.float32)))
        x = torch.from_numpy(r.normal(scale=2.0, size=(2, 13, hidden)).astype(np.float32))
        ref = gate(x)
        g_raw = gate.f_b_proj(gate.f_a_proj(x)).view(2, 13, H, D)
    assert (g_raw + gate.dt_bias.view(H, D)).abs().max() > 20.0  # exercises softplus' linear branch
    ours = kda_gate(to_jnp(g_raw), to_jnp(gate.A_log.view(H)), to_jnp(gate.dt_bias))
    assert_close("kda_gate vs kimi KimiLinearForgetGate", ours, ref)
