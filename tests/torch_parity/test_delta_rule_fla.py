"""GDN / KDA recurrences and gates vs fla-core's pure-torch references (fla.ops.*.naive, naive_*_gate)."""

import numpy as np
import pytest
import torch.nn.functional as F
from fla.ops.gated_delta_rule.gate import naive_gdn_gate
from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule
from fla.ops.kda.gate import naive_kda_gate
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

from apriel2_jax.ops.delta_rule import gdn_gate, kda_gate

from .helpers import assert_close, delta_inputs, ours_seq, ours_steps, rng, to_jnp, to_torch, torch_inputs

T = 37
GDN_HEADS = [(2, 2), (2, 4)]  # (H_k, H_v)
KDA_CASES = [(2, 2, 16), (2, 4, 5)]  # (H_k, H_v, our chunk size)


def gdn_case(h_k, h_v):
    return delta_inputs(h_v, T, h_k, h_v, 16, 24, kda=False)


def kda_case(h_k, h_v):
    return delta_inputs(100 + h_v, T, h_k, h_v, 16, 16, kda=True)


# ---------------------------------------------------------------------------------------------------------------
# GDN: fla's naive functions take normalised q/k with H_v heads, scale defaults to K^-1/2.


def fla_gdn_recurrent(inp):
    t = torch_inputs(inp, normalise=True, expand=True)
    return naive_recurrent_gated_delta_rule(
        t["q"], t["k"], t["v"], t["beta"], t["g"], initial_state=t["s0"], output_final_state=True
    )


@pytest.mark.parametrize("h_k,h_v", GDN_HEADS)
@pytest.mark.parametrize("chunk", [8, 64])
def test_gdn_vs_naive_recurrent(h_k, h_v, chunk):
    inp = gdn_case(h_k, h_v)
    ref_o, ref_s = fla_gdn_recurrent(inp)
    o, s = ours_seq(inp, chunk, kda=False)
    assert_close(f"gdn seq chunk={chunk} Hk={h_k} Hv={h_v} vs fla naive_recurrent: o", o, ref_o)
    assert_close(f"gdn seq chunk={chunk} Hk={h_k} Hv={h_v} vs fla naive_recurrent: state", s, ref_s)


@pytest.mark.parametrize("h_k,h_v", GDN_HEADS)
def test_gdn_vs_naive_chunk(h_k, h_v):
    """fla's naive chunk form at its chunk size 16 (pads T=37 to 48 internally) vs ours at chunk 8."""
    inp = gdn_case(h_k, h_v)
    t = torch_inputs(inp, normalise=True, expand=True)
    ref_o, ref_s = naive_chunk_gated_delta_rule(
        t["q"], t["k"], t["v"], t["g"], t["beta"], chunk_size=16, initial_state=t["s0"], output_final_state=True
    )
    o, s = ours_seq(inp, 8, kda=False)
    assert_close(f"gdn seq Hk={h_k} Hv={h_v} vs fla naive_chunk: o", o, ref_o)
    assert_close(f"gdn seq Hk={h_k} Hv={h_v} vs fla naive_chunk: state", s, ref_s)


@pytest.mark.parametrize("h_k,h_v", GDN_HEADS)
def test_gdn_step_vs_naive_recurrent(h_k, h_v):
    inp = gdn_case(h_k, h_v)
    ref_o, ref_s = fla_gdn_recurrent(inp)
    o, s = ours_steps(inp, kda=False)
    assert_close(f"gdn step Hk={h_k} Hv={h_v} vs fla naive_recurrent: o", o, ref_o)
    assert_close(f"gdn step Hk={h_k} Hv={h_v} vs fla naive_recurrent: state", s, ref_s)


def test_gdn_gate_vs_fla():
    r = rng(4)
    a = r.normal(scale=8.0, size=(2, 13, 4))
    a[0, 0] = [25.0, 19.5, -30.0, 0.0]  # both sides of softplus' threshold (20)
    A_log, dt_bias = r.normal(size=4), r.normal(size=4)
    ref = naive_gdn_gate(to_torch(a), to_torch(A_log), to_torch(dt_bias))
    assert_close("gdn_gate vs fla naive_gdn_gate", gdn_gate(to_jnp(a), to_jnp(A_log), to_jnp(dt_bias)), ref)


# ---------------------------------------------------------------------------------------------------------------
# KDA: fla's naive KDA takes normalised q/k with H_k heads (expands to H_v itself).


def fla_kda_recurrent(inp):
    t = torch_inputs(inp, normalise=True, expand=False)
    return naive_recurrent_kda(
        t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["s0"], output_final_state=True
    )


@pytest.mark.parametrize("h_k,h_v,chunk", KDA_CASES)
def test_kda_vs_naive_recurrent(h_k, h_v, chunk):
    inp = kda_case(h_k, h_v)
    ref_o, ref_s = fla_kda_recurrent(inp)
    o, s = ours_seq(inp, chunk, kda=True)
    assert_close(f"kda seq chunk={chunk} Hk={h_k} Hv={h_v} vs fla naive_recurrent_kda: o", o, ref_o)
    assert_close(f"kda seq chunk={chunk} Hk={h_k} Hv={h_v} vs fla naive_recurrent_kda: state", s, ref_s)


@pytest.mark.parametrize("h_k,h_v,chunk", KDA_CASES)
def test_kda_vs_naive_chunk(h_k, h_v, chunk):
    """naive_chunk_kda needs T % 16 == 0: pad T=37 to 48 with identity tokens (g = 0, beta = 0)."""
    inp = kda_case(h_k, h_v)
    t = torch_inputs(inp, normalise=True, expand=False)
    pad = {n: F.pad(t[n], (0, 0) * (t[n].dim() - 2) + (0, 11)) for n in ("q", "k", "v", "g", "beta")}
    ref_o, ref_s = naive_chunk_kda(
        pad["q"], pad["k"], pad["v"], pad["g"], pad["beta"], initial_state=t["s0"], output_final_state=True,
        chunk_size=16,
    )
    o, s = ours_seq(inp, chunk, kda=True)
    assert_close(f"kda seq chunk={chunk} Hk={h_k} Hv={h_v} vs fla naive_chunk_kda: o", o, ref_o[:, :T])
    assert_close(f"kda seq chunk={chunk} Hk={h_k} Hv={h_v} vs fla naive_chunk_kda: state", s, ref_s)


@pytest.mark.parametrize("h_k,h_v", [(2, 2), (2, 4)])
def test_kda_step_vs_naive_recurrent(h_k, h_v):
    inp = kda_case(h_k, h_v)
    ref_o, ref_s = fla_kda_recurrent(inp)
    o, s = ours_steps(inp, kda=True)
    assert_close(f"kda step Hk={h_k} Hv={h_v} vs fla naive_recurrent_kda: o", o, ref_o)
    assert_close(f"kda step Hk={h_k} Hv={h_v} vs fla naive_recurrent_kda: state", s, ref_s)


def test_kda_gate_vs_fla():
    r = rng(8)
    H, D = 3, 8
    g_raw = r.normal(scale=8.0, size=(2, 13, H, D))
    g_raw[0, 0, 0, :3] = [25.0, 19.5, -30.0]
    A_log, dt_bias = r.normal(size=H), r.normal(size=H * D)
    ref = naive_kda_gate(to_torch(g_raw), to_torch(A_log), to_torch(dt_bias))
    assert_close("kda_gate vs fla naive_kda_gate", kda_gate(to_jnp(g_raw), to_jnp(A_log), to_jnp(dt_bias)), ref)
    assert np.all(np.asarray(kda_gate(to_jnp(g_raw), to_jnp(A_log), to_jnp(dt_bias))) <= 0.0)
