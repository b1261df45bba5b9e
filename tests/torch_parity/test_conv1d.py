"""Causal depthwise conv1d vs torch.nn.functional.conv1d (groups=C) and transformers' Qwen3-Next torch
fallbacks (causal_conv1d_fn, causal_conv1d_update), with non-zero initial states and the returned states."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from apriel2_jax.ops.conv import causal_conv1d, causal_conv1d_step

from .helpers import assert_close, rng, to_jnp, to_torch, torch_fallback

causal_conv1d_fn = torch_fallback(qwen3_next.causal_conv1d_fn)
causal_conv1d_update = torch_fallback(qwen3_next.causal_conv1d_update)

B, T, C, K = 2, 13, 12, 4


def make(seed):
    r = rng(seed)
    shapes = [(B, T, C), (C, K), (C,), (B, K - 1, C)]  # x, weight, bias, state
    return [r.normal(size=s).astype(np.float32) for s in shapes]


def torch_conv(x, w, b, state, activation):
    """Reference: prepend the state along time ([B, C, K-1+T]), depthwise conv1d without padding, activation.
    Returns y [B, T, C] and the last K-1 inputs [B, K-1, C]."""
    xin = torch.cat([to_torch(state), to_torch(x)], dim=1).transpose(1, 2)
    y = F.conv1d(xin, to_torch(w).unsqueeze(1), None if b is None else to_torch(b), groups=C)
    if activation == "silu":
        y = F.silu(y)
    return y.transpose(1, 2), xin[:, :, -(K - 1):].transpose(1, 2)


def ours(x, w, b, state, activation):
    return causal_conv1d(to_jnp(x), to_jnp(w), None if b is None else to_jnp(b), to_jnp(state), activation)


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("use_bias", [True, False])
def test_conv_with_state_vs_torch_conv1d(activation, use_bias):
    x, w, b, state = make(0)
    b = b if use_bias else None
    ref_y, ref_state = torch_conv(x, w, b, state, activation)
    y, new_state = ours(x, w, b, state, activation)
    assert_close(f"causal_conv1d act={activation} bias={use_bias} vs F.conv1d: y", y, ref_y)
    assert_close(f"causal_conv1d act={activation} bias={use_bias} vs F.conv1d: state", new_state, ref_state)


def test_conv_zero_state_vs_left_padding_and_hf_fn():
    """No state == zero history == F.pad(K-1 left) + conv1d == HF causal_conv1d_fn (padding=K-1, sliced)."""
    x, w, b, _ = make(1)
    xt = to_torch(x).transpose(1, 2)
    ref = F.silu(F.conv1d(F.pad(xt, (K - 1, 0)), to_torch(w).unsqueeze(1), to_torch(b), groups=C)).transpose(1, 2)
    hf = causal_conv1d_fn(xt, to_torch(w), to_torch(b), activation="silu").transpose(1, 2)
    y, state = causal_conv1d(to_jnp(x), to_jnp(w), to_jnp(b), None, "silu")
    assert_close("causal_conv1d no state vs F.pad + F.conv1d", y, ref)
    assert_close("causal_conv1d no state vs qwen3_next causal_conv1d_fn", y, hf)
    assert_close("causal_conv1d no state: state == last K-1 inputs", state, x[:, -(K - 1):])


def test_conv_segments_chain_state():
    """Segments of 5, 2 (< K-1) and 6 tokens, each starting from the previous segment's state, equal one conv
    over the whole sequence."""
    x, w, b, state = make(2)
    ref_y, ref_state = torch_conv(x, w, b, state, "silu")
    s, ys = to_jnp(state), []
    for lo, hi in [(0, 5), (5, 7), (7, T)]:
        y, s = causal_conv1d(to_jnp(x[:, lo:hi]), to_jnp(w), to_jnp(b), s, "silu")
        ys.append(y)
    assert_close("causal_conv1d in 3 segments vs F.conv1d: y", jnp.concatenate(ys, axis=1), ref_y)
    assert_close("causal_conv1d in 3 segments vs F.conv1d: state", s, ref_state)


def test_conv_step_and_seq_vs_hf_update():
    """HF causal_conv1d_update keeps the state as [B, C, K-1] and updates it in place; it takes 1 or T tokens."""
    x, w, b, state = make(3)
    hf_state = to_torch(state).transpose(1, 2).contiguous()
    hf_y = causal_conv1d_update(to_torch(x).transpose(1, 2), hf_state, to_torch(w), to_torch(b), "silu")
    y, new_state = ours(x, w, b, state, "silu")
    name = "causal_conv1d vs qwen3_next causal_conv1d_update (T tokens)"
    assert_close(name + ": y", y, hf_y.transpose(1, 2))
    assert_close(name + ": state", new_state, hf_state.transpose(1, 2))

    hf_state = to_torch(state).transpose(1, 2).contiguous()
    s, ys, ref_ys = to_jnp(state), [], []
    for t in range(T):
        ref_ys.append(causal_conv1d_update(to_torch(x[:, t, :, None]), hf_state, to_torch(w), to_torch(b), "silu"))
        y_t, s = causal_conv1d_step(to_jnp(x[:, t]), to_jnp(w), to_jnp(b), s, "silu")
        ys.append(y_t)
        assert_close(f"causal_conv1d_step t={t} vs causal_conv1d_update: state", s, hf_state.transpose(1, 2))
    ref_y = torch.cat(ref_ys, 2).transpose(1, 2)
    assert_close("causal_conv1d_step vs qwen3_next causal_conv1d_update: y", jnp.stack(ys, 1), ref_y)
