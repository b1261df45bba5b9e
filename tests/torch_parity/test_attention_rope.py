"""RoPE and causal / sliding-window GQA attention vs transformers' Mistral (MistralRotaryEmbedding,
apply_rotary_pos_emb, eager_attention_forward) with masks from transformers.masking_utils."""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import MistralConfig
from transformers.masking_utils import causal_mask_function, eager_mask, sliding_window_causal_mask_function
from transformers.models.mistral.modeling_mistral import (
    MistralRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from apriel2_jax.ops.attention import attention
from apriel2_jax.ops.rope import apply_rope, rope_cos_sin

from .helpers import assert_close, rng, to_jnp, to_torch

B, T, D = 2, 13, 32


def mistral_rope(head_dim, theta):
    config = MistralConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    return MistralRotaryEmbedding(config)


@pytest.mark.parametrize("theta,offset", [(10000.0, 0), (10000.0, 2000), (1e6, 70000)])
def test_rope_vs_mistral(theta, offset):
    """cos/sin tables and the NeoX half rotation of q [B,T,H,D] and k [B,T,G,D] (unsqueeze_dim=2)."""
    positions = np.stack([np.arange(T), np.arange(T) + offset]).astype(np.int32)  # batch rows at different offsets
    r = rng(0)
    q, k = r.normal(size=(B, T, 4, D)).astype(np.float32), r.normal(size=(B, T, 2, D)).astype(np.float32)
    ref_cos, ref_sin = mistral_rope(D, theta)(to_torch(q), torch.from_numpy(positions).long())
    ref_q, ref_k = apply_rotary_pos_emb(to_torch(q), to_torch(k), ref_cos, ref_sin, unsqueeze_dim=2)
    cos, sin = rope_cos_sin(jnp.asarray(positions), D, theta, jnp.float32)
    name = f"rope theta={theta:g} positions up to {offset + T - 1}"
    assert_close(name + ": cos", cos, ref_cos)
    assert_close(name + ": sin", sin, ref_sin)
    assert_close(name + ": q", apply_rope(to_jnp(q), cos, sin), ref_q)
    assert_close(name + ": k", apply_rope(to_jnp(k), cos, sin), ref_k)


def hf_attention(q, k, v, mask):
    """q [B,T,H,D], k/v [B,S,G,D] -> transformers' eager attention with an additive [B,1,T,S] mask."""
    module = SimpleNamespace(num_key_value_groups=q.shape[2] // k.shape[2], training=False)
    out, _ = eager_attention_forward(
        module, *(to_torch(x).transpose(1, 2) for x in (q, k, v)), mask, scaling=q.shape[-1] ** -0.5
    )
    return out


@pytest.mark.parametrize("heads,groups", [(4, 2), (6, 2), (4, 4)])
@pytest.mark.parametrize("window", [None, 5])
def test_attention_prefill_vs_mistral_eager(heads, groups, window):
    r = rng(heads + groups)
    q = r.normal(size=(B, T, heads, D)).astype(np.float32)
    k, v = (r.normal(size=(B, T, groups, D)).astype(np.float32) for _ in range(2))
    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    mask = eager_mask(B, T, T, mask_function=mask_fn)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    out = attention(to_jnp(q), to_jnp(k), to_jnp(v), pos, pos, window=window)
    name = f"attention prefill H={heads} G={groups} window={window} vs mistral eager"
    assert_close(name, out, hf_attention(q, k, v, mask))


@pytest.mark.parametrize("window", [None, 6])
def test_attention_chunk_with_cache_and_padding_vs_mistral_eager(window):
    """3 new queries at positions 14..16 against 17 cached+new keys (HF q_offset=14); batch row 1 is left padded
    (its first 3 keys invalid: kv_valid / HF 2D attention_mask)."""
    heads, groups, S, Tq = 4, 2, 17, 3
    r = rng(7)
    q = r.normal(size=(B, Tq, heads, D)).astype(np.float32)
    k, v = (r.normal(size=(B, S, groups, D)).astype(np.float32) for _ in range(2))
    valid = np.ones((B, S), bool)
    valid[1, :3] = False
    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    mask = eager_mask(B, Tq, S, q_offset=S - Tq, mask_function=mask_fn, attention_mask=torch.from_numpy(valid))
    q_pos = jnp.broadcast_to(jnp.arange(S - Tq, S), (B, Tq))
    kv_pos = jnp.broadcast_to(jnp.arange(S), (B, S))
    out = attention(to_jnp(q), to_jnp(k), to_jnp(v), q_pos, kv_pos, jnp.asarray(valid), window=window)
    name = f"attention 3 queries / 17 keys, padding, window={window} vs mistral eager"
    assert_close(name, out, hf_attention(q, k, v, mask))
