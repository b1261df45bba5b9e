"""GDN vs transformers' Qwen3-Next pure-torch fallbacks (torch_chunk_gated_delta_rule, torch_recurrent_...).

Both take raw q/k with use_qk_l2norm_in_kernel=True but need key heads already expanded to the value heads
(the Qwen3-Next layer does the repeat_interleave itself), so we expand on the torch side."""

import pytest
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from .helpers import assert_close, delta_inputs, ours_seq, ours_steps, torch_fallback, torch_inputs

torch_chunk_gated_delta_rule = torch_fallback(qwen3_next.torch_chunk_gated_delta_rule)
torch_recurrent_gated_delta_rule = torch_fallback(qwen3_next.torch_recurrent_gated_delta_rule)

GDN_HEADS = [(2, 2), (2, 4)]


def hf(fn, inp, **kw):
    t = torch_inputs(inp, normalise=False, expand=True)
    return fn(
        t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["s0"], output_final_state=True,
        use_qk_l2norm_in_kernel=True, **kw,
    )


@pytest.mark.parametrize(
    "h_k,h_v,T,hf_chunk", [(2, 2, 37, 64), (2, 4, 37, 64), (2, 2, 37, 16), (2, 4, 37, 16), (2, 4, 100, 64)]
)
def test_gdn_vs_torch_chunk(h_k, h_v, T, hf_chunk):
    """HF pads T up to a multiple of its chunk: 37 -> one padded 64-chunk, 37 -> 3 padded 16-chunks,
    100 -> 2 chunks of 64 (28 padding tokens). Ours at chunk 64 (its own padding for T=100) and chunk 8."""
    inp = delta_inputs(h_v, T, h_k, h_v, 16, 24, kda=False)
    ref_o, ref_s = hf(torch_chunk_gated_delta_rule, inp, chunk_size=hf_chunk)
    for chunk in (8, 64) if T == 37 else (64,):
        o, s = ours_seq(inp, chunk, kda=False)
        name = f"gdn seq chunk={chunk} T={T} Hk={h_k} Hv={h_v} vs qwen3_next torch_chunk(chunk={hf_chunk})"
        assert_close(name + ": o", o, ref_o)
        assert_close(name + ": state", s, ref_s)


@pytest.mark.parametrize("h_k,h_v", GDN_HEADS)
def test_gdn_vs_torch_recurrent(h_k, h_v):
    inp = delta_inputs(h_v, 37, h_k, h_v, 16, 24, kda=False)
    ref_o, ref_s = hf(torch_recurrent_gated_delta_rule, inp)
    for name, (o, s) in [("seq chunk=8", ours_seq(inp, 8, kda=False)), ("step", ours_steps(inp, kda=False))]:
        assert_close(f"gdn {name} Hk={h_k} Hv={h_v} vs qwen3_next torch_recurrent: o", o, ref_o)
        assert_close(f"gdn {name} Hk={h_k} Hv={h_v} vs qwen3_next torch_recurrent: state", s, ref_s)
