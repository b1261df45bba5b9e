"""An independent float64 NumPy re-derivation of the Apriel2 forward pass, written from spec §1-§2
(``shared/docs/apriel2_spec.md``) and not from ``apriel2_jax``.

It is the oracle for config variants the golden checkpoints (``shared/goldens``) do not cover: layer-norm blocks,
non-gated MLPs with biases, other activations, other conv kernel sizes, Mamba bias and size defaults, sliding
windows, GQA ratios, GDN head ratios, tied embeddings... ``tests/test_spec_reference.py`` first checks it against
every golden case, then checks the float32 JAX model against it on such variants.

Only the semantics are taken from the spec; nothing is vectorised the way the JAX code is. Everything runs in
float64 on one sequence, over the whole sequence, with no cache: the recurrences (§2.6-§2.8) are plain loops over
time, attention (§2.3) is an explicit masked softmax, the conv (§2.4) an explicit sum over taps. Where the spec
says HF and vLLM differ, this follows HF (the numerical reference), including its quirks: block norms use the
head epsilon (§2.1), Mamba adds ``dt_proj.bias`` twice (§2.8), Mamba reads ``state_size`` and ignores
``d_state`` (§1.3), the gated MLP has no biases (§1.3). Sliding windows follow the true semantics (§2.3: each
query sees the last ``window_size`` positions including itself), not HF's truncated cache.

Use::

    ref = SpecReference.from_checkpoint(directory)      # config.json + model.safetensors (or a sharded index)
    ref = SpecReference(config_dict, weights_dict)      # or in memory
    logits = ref.logits(input_ids, placement)           # ids [T] or [B, T] -> float64 [T, V] or [B, T, V]

A placement is None (every stochastic layer runs its ``main_mixer_name``), one mixer name per layer (None for
fixed layers), or a ``{"layer": name}`` mapping naming every stochastic layer (the goldens' placements.json).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np
from safetensors.numpy import load_file

Config = Mapping[str, Any]
Weights = Mapping[str, np.ndarray]
Placement = None | Sequence[str | None] | Mapping[str, str]

__all__ = ["SpecReference", "parameter_shapes", "load_checkpoint"]


# ----------------------------------------------------------------------------------------------------------------
# Config reading (spec §1)


def _get(node: Config | None, key: str, default: Any = None) -> Any:
    """``node[key]``, with a missing key and an explicit JSON null both meaning ``default``."""
    if node is None:
        return default
    value = node.get(key)
    return default if value is None else value


def _bias(node: Config, layer: str, default: bool) -> bool:
    """A per-projection ``{"bias": {"enabled": bool}}`` override falling back to ``default`` (§1.3)."""
    enabled = _get(_get(_get(node, layer), "bias"), "enabled")
    return default if enabled is None else bool(enabled)


def block_configs(config: Config) -> list[Config]:
    """The block config of every layer (§1.2): ``fixed`` repeats ``block``, ``pattern`` cycles ``pattern``."""
    decoder = config["decoder"]
    count = decoder["num_blocks"]
    if _get(decoder, "type", "fixed") == "fixed":
        return [decoder["block"]] * count
    pattern = decoder["pattern"]
    return [decoder["blocks"][pattern[i % len(pattern)]] for i in range(count)]


def _sub_mixers(mixer: Config) -> list[tuple[str, Config]]:
    """(key suffix, leaf mixer config) for every leaf mixer of a block's mixer (§1.5: ``mixer.mixers.{name}.``)."""
    if _get(mixer, "type", "attention") == "stochastic":
        return [(f"mixers.{name}.", sub) for name, sub in mixer["mixers"].items()]
    return [("", mixer)]


def _placement_names(config: Config, placement: Placement) -> list[str | None]:
    """The active sub-mixer name per layer (None for fixed layers), §3.2: by default ``main_mixer_name``, which
    defaults to the first key of ``mixers``."""
    blocks = block_configs(config)
    names: list[str | None] = []
    for i, block in enumerate(blocks):
        mixer = _get(block, "mixer", {})
        if _get(mixer, "type", "attention") != "stochastic":
            names.append(None)
            continue
        if placement is None:
            name = _get(mixer, "main_mixer_name", next(iter(mixer["mixers"])))
        elif isinstance(placement, Mapping):
            name = placement[str(i)]
        else:
            name = placement[i]
        if name not in mixer["mixers"]:
            raise ValueError(f"layer {i}: placement names {name!r}, the layer has {list(mixer['mixers'])}")
        names.append(name)
    return names


def _attention_dims(m: Config) -> tuple[int, int, int]:
    """(H, G, h_d) of an attention mixer (§1.3: ``head_groups`` defaults to ``heads``)."""
    heads = m["heads"]
    return heads, _get(m, "head_groups", heads), m["head_size"]


def _gdn_dims(m: Config) -> tuple[int, int, int, int, int]:
    """(H_v, H_k, d_k, d_v, K) of a GDN mixer (§1.3 defaults; ``convolution_layer.kernel_size`` is required)."""
    return (_get(m, "value_heads", 32), _get(m, "key_heads", 8), _get(m, "key_head_dim", 64),
            _get(m, "value_head_dim", 64), m["convolution_layer"]["kernel_size"])


def _kda_dims(m: Config) -> tuple[int, int, int]:
    """(H, D, K) of a KDA mixer (§1.3 defaults: 32 heads of 64, kernel 4)."""
    return _get(m, "heads", 32), _get(m, "head_dim", 64), _get(_get(m, "convolution_layer"), "kernel_size", 4)


def _mamba_dims(m: Config, hidden: int) -> tuple[int, int, int, int, int]:
    """(D_in, D_xb, N, R, K) of a Mamba mixer (§1.3): ``d_inner`` defaults to expand·d (expand 2), ``d_xb`` to d,
    ``state_size`` to 16 (``d_state`` is ignored), ``dt_rank`` "auto" to ceil(d/16), ``d_conv`` to 4."""
    d_inner = _get(m, "d_inner") or _get(m, "expand", 2) * hidden
    dt_rank = _get(m, "dt_rank", "auto")
    if dt_rank == "auto":
        dt_rank = math.ceil(hidden / 16)
    return d_inner, _get(m, "d_xb", hidden), _get(m, "state_size", 16), dt_rank, _get(m, "d_conv", 4)


# ----------------------------------------------------------------------------------------------------------------
# Parameter table (spec §1.4 and the weight tables of §2.1-§2.8)


def _mixer_shapes(m: Config, hidden: int) -> dict[str, tuple[int, ...]]:
    kind = _get(m, "type", "attention")
    d = hidden
    if kind == "attention":  # §2.3
        heads, groups, hd = _attention_dims(m)
        default = bool(_get(m, "add_linear_biases", False))
        shapes = {"q_proj": (heads * hd, d), "k_proj": (groups * hd, d), "v_proj": (groups * hd, d),
                  "o_proj": (d, heads * hd)}
        flags = {"q_proj": "query_layer", "k_proj": "key_layer", "v_proj": "value_layer", "o_proj": "dense_layer"}
        out = {f"{name}.weight": shape for name, shape in shapes.items()}
        out.update({f"{name}.bias": shape[:1] for name, shape in shapes.items() if _bias(m, flags[name], default)})
        return out
    if kind == "gdn":  # §2.6
        hv, hk, dk, dv, k = _gdn_dims(m)
        return {"in_proj_qkvz.weight": (2 * hk * dk + 2 * hv * dv, d), "in_proj_ba.weight": (2 * hv, d),
                "convolution.weight": (2 * hk * dk + hv * dv, 1, k), "out_proj.weight": (d, hv * dv),
                "dt_bias": (hv,), "A_log": (hv,), "norm.weight": (dv,)}
    if kind == "kda":  # §2.7
        heads, dim, k = _kda_dims(m)
        p = heads * dim
        out = {f"{n}_proj.weight": (p, d) for n in "qkv"}
        out.update({f"{n}_conv.weight": (p, 1, k) for n in "qkv"})
        out.update({"f_a_proj.weight": (dim, d), "f_b_proj.weight": (p, dim), "g_a_proj.weight": (dim, d),
                    "g_b_proj.weight": (p, dim), "beta_proj.weight": (heads, d), "o_proj.weight": (d, p),
                    "A_log": (heads,), "dt_bias": (p,), "norm.weight": (dim,)})
        return out
    if kind == "mamba":  # §2.8
        d_in, d_xb, n, rank, k = _mamba_dims(m, hidden)
        conv = d_in if _get(m, "repeat_kv_before_conv", True) else d_xb
        out = {"in_proj.weight": (2 * d_in + 2 * d_xb, d), "dt_in_proj.weight": (rank, d),
               "dt_proj.weight": (d_in, rank), "conv1d.weight": (conv, 1, k), "A_log": (d_in, n), "D": (d_in,),
               "out_proj.weight": (d, d_in)}
        if m["conv_bias"]:
            out["conv1d.bias"] = (conv,)
        if m["dt_proj_bias"]:
            out["dt_proj.bias"] = (d_in,)
        if _get(m, "add_linear_biases", False):
            out.update({"in_proj.bias": (2 * d_in + 2 * d_xb,), "dt_in_proj.bias": (rank,), "out_proj.bias": (d,)})
        return out
    raise ValueError(f"unknown mixer type {kind!r}")


def _mlp_shapes(m: Config, hidden: int) -> dict[str, tuple[int, ...]]:
    """§2.2: gated has gate/up/down and never biases; non-gated has up/down with ``layer_1``/``layer_2`` biases."""
    inter = m["intermediate_size"]
    if _get(m, "gated", True):
        return {"gate_proj.weight": (inter, hidden), "up_proj.weight": (inter, hidden),
                "down_proj.weight": (hidden, inter)}
    default = bool(_get(m, "add_linear_biases", False))
    out = {"up_proj.weight": (inter, hidden), "down_proj.weight": (hidden, inter)}
    if _bias(m, "layer_1", default):
        out["up_proj.bias"] = (inter,)
    if _bias(m, "layer_2", default):
        out["down_proj.bias"] = (hidden,)
    return out


def parameter_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """Every checkpoint key of the text model and its PyTorch shape, per the spec's tables."""
    d, vocab = config["hidden_size"], config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    if not _get(config, "tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, d)
    for i, block in enumerate(block_configs(config)):
        prefix = f"model.decoder.blocks.{i}."
        norm_keys = ["weight", "bias"] if _get(_get(block, "normalization"), "type", "rms_norm") == "layer_norm" \
            else ["weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes.update({f"{prefix}{norm}.{k}": (d,) for k in norm_keys})
        for sub, mixer in _sub_mixers(_get(block, "mixer", {})):
            shapes.update({f"{prefix}mixer.{sub}{k}": s for k, s in _mixer_shapes(mixer, d).items()})
        shapes.update({f"{prefix}mlp.{k}": s for k, s in _mlp_shapes(block["mlp"], d).items()})
    return shapes


# ----------------------------------------------------------------------------------------------------------------
# Primitives


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """softplus with threshold 20 (§2.6 step 5): x itself above 20."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


_erf = np.vectorize(math.erf, otypes=[np.float64])


def activation(name: str, x: np.ndarray) -> np.ndarray:
    """The transformers ``ACT2FN`` activations the variants use (§1.3: the MLP's ``activation``)."""
    if name in ("silu", "swish"):
        return silu(x)
    if name == "sigmoid":
        return sigmoid(x)
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "gelu":  # exact, erf form
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    raise ValueError(f"activation {name!r} is not in the reference")


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """PyTorch Linear (§2.0): y = x Wᵀ + b with W [out, in]."""
    y = x @ weight.T
    return y if bias is None else y + bias


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """§2.1: w ⊙ x / sqrt(mean(x²) + ε)."""
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """``nn.LayerNorm`` (§1.3, ``type: layer_norm``): biased variance, weight and bias."""
    centred = x - x.mean(axis=-1, keepdims=True)
    return centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + eps) * weight + bias


def gated_rms_norm(o: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float, act: str = "silu") -> np.ndarray:
    """§2.5: w ⊙ o / sqrt(mean(o²) + ε) ⊙ act(z), per head vector (last axis)."""
    return weight * (o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps)) * activation(act, z)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """§2.6 step 6: x / sqrt(‖x‖² + 1e-6) per head vector."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def causal_conv1d_silu(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """§2.4 with zero history: y[t,c] = silu(Σ_j w[c,0,j] · x[t-(K-1)+j, c] + b[c]); tap K-1 is the current token.
    x: [T, C]; weight: [C, 1, K]."""
    length, channels = x.shape
    taps = weight.shape[-1]
    padded = np.concatenate([np.zeros((taps - 1, channels)), x], axis=0)
    y = np.zeros((length, channels))
    for t in range(length):
        for j in range(taps):
            y[t] += weight[:, 0, j] * padded[t + j]  # padded[t + j] is x[t - (K-1) + j]
    if bias is not None:
        y = y + bias
    return silu(y)


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """The GDN/KDA recurrence for one head (§2.6 step 7, §2.7 step 5), state S [d_k, d_v] from zeros.
    q, k: [T, d_k] (already L2-normalised, q scaled); v: [T, d_v]; g: [T, d_k] log decay per key row (GDN: one
    value repeated); beta: [T]. Per t: decay, then delta write, then read (the output includes this token)."""
    state = np.zeros((q.shape[1], v.shape[1]))
    out = np.zeros_like(v)
    for t in range(q.shape[0]):
        state = np.exp(g[t])[:, None] * state
        u = beta[t] * (v[t] - state.T @ k[t])
        state = state + np.outer(k[t], u)
        out[t] = state.T @ q[t]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Mixers (spec §2.3, §2.6, §2.7, §2.8). Each maps a [T, d] normalised input to a [T, d] output; ``p`` is the key
# prefix of the mixer's tensors (``model.decoder.blocks.{i}.mixer.`` [+ ``mixers.{name}.``]).


def rotary(x: np.ndarray, theta: float) -> np.ndarray:
    """§2.3 step 2, ``mistral_1d`` (NeoX half rotation) at positions 0..T-1. x: [T, heads, h_d]."""
    length, _, hd = x.shape
    inv_freq = theta ** (-2.0 * np.arange(hd // 2) / hd)
    phi = np.arange(length)[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(phi), np.cos(phi)], axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(phi), np.sin(phi)], axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], axis=-1)
    return x * cos + rotated * sin


def attention(x: np.ndarray, w: Weights, p: str, m: Config) -> np.ndarray:
    """§2.3: projections with per-projection biases, RoPE on q and k, GQA by ⌊h / (H/G)⌋, causal softmax with an
    optional window (key τ visible from query t iff t - W < τ ≤ t), heads concatenated head-major, o_proj."""
    length = x.shape[0]
    heads, groups, hd = _attention_dims(m)
    default = bool(_get(m, "add_linear_biases", False))

    def project(name: str, flag: str, count: int) -> np.ndarray:
        bias = w[f"{p}{name}.bias"] if _bias(m, flag, default) else None
        return linear(x, w[f"{p}{name}.weight"], bias).reshape(length, count, hd)

    theta = m["rotary"]["theta"]
    q = rotary(project("q_proj", "query_layer", heads), theta)
    k = rotary(project("k_proj", "key_layer", groups), theta)
    v = project("v_proj", "value_layer", groups)
    t, tau = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = tau <= t
    window = _get(m, "window_size")
    if window is not None:
        visible &= tau > t - window
    out = np.zeros((length, heads, hd))
    for h in range(heads):
        g = h // (heads // groups)
        scores = np.where(visible, q[:, h] @ k[:, g].T / math.sqrt(hd), -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[:, h] = (probs / probs.sum(axis=-1, keepdims=True)) @ v[:, g]
    o_bias = w[f"{p}o_proj.bias"] if _bias(m, "dense_layer", default) else None
    return linear(out.reshape(length, heads * hd), w[f"{p}o_proj.weight"], o_bias)


def gdn(x: np.ndarray, w: Weights, p: str, m: Config) -> np.ndarray:
    """§2.6: flat [Q‖K‖V‖Z] and [b‖a] projections, conv over [Q‖K‖V], value head j reads key head ⌊j/r⌋."""
    length = x.shape[0]
    hv, hk, dk, dv, _ = _gdn_dims(m)
    r = hv // hk
    qkvz = linear(x, w[p + "in_proj_qkvz.weight"])
    ba = linear(x, w[p + "in_proj_ba.weight"])
    c_qkv = 2 * hk * dk + hv * dv
    u = causal_conv1d_silu(qkvz[:, :c_qkv], w[p + "convolution.weight"])  # step 2: no bias
    q = u[:, : hk * dk].reshape(length, hk, dk)
    k = u[:, hk * dk: 2 * hk * dk].reshape(length, hk, dk)
    v = u[:, 2 * hk * dk:].reshape(length, hv, dv)
    z = qkvz[:, c_qkv:].reshape(length, hv, dv)
    beta = sigmoid(ba[:, :hv])  # step 5
    g = -np.exp(w[p + "A_log"]) * softplus(ba[:, hv:] + w[p + "dt_bias"])  # [T, H_v]
    out = np.zeros((length, hv, dv))
    for j in range(hv):  # steps 4, 6, 7
        q_hat = l2_normalize(q[:, j // r]) * dk**-0.5
        k_hat = l2_normalize(k[:, j // r])
        decay = np.repeat(g[:, j:j + 1], dk, axis=1)
        out[:, j] = gated_delta_rule(q_hat, k_hat, v[:, j], decay, beta[:, j])
    eps = _get(m, "norm_eps", 1e-5)
    y = gated_rms_norm(out, z, w[p + "norm.weight"], eps)  # step 8
    return linear(y.reshape(length, hv * dv), w[p + "out_proj.weight"])


def kda(x: np.ndarray, w: Weights, p: str, m: Config) -> np.ndarray:
    """§2.7: three separate convs, a low-rank per-channel decay gate, the delta rule with channel-wise decay, a
    low-rank output gate through the gated RMSNorm (activation ``normalization.activation``)."""
    length = x.shape[0]
    heads, dim, _ = _kda_dims(m)

    def branch(n: str) -> np.ndarray:  # step 1
        return causal_conv1d_silu(linear(x, w[f"{p}{n}_proj.weight"]), w[f"{p}{n}_conv.weight"]).reshape(
            length, heads, dim)

    q, k, v = branch("q"), branch("k"), branch("v")
    g_raw = linear(linear(x, w[p + "f_a_proj.weight"]), w[p + "f_b_proj.weight"]).reshape(length, heads, dim)
    g = -np.exp(w[p + "A_log"])[None, :, None] * softplus(g_raw + w[p + "dt_bias"].reshape(heads, dim))  # step 2
    beta = sigmoid(linear(x, w[p + "beta_proj.weight"]))  # step 3, [T, H]
    out = np.zeros((length, heads, dim))
    for h in range(heads):  # steps 4-5
        out[:, h] = gated_delta_rule(l2_normalize(q[:, h]) * dim**-0.5, l2_normalize(k[:, h]), v[:, h], g[:, h],
                                     beta[:, h])
    gate = linear(linear(x, w[p + "g_a_proj.weight"]), w[p + "g_b_proj.weight"]).reshape(length, heads, dim)
    norm = _get(m, "normalization", {})
    y = gated_rms_norm(out, gate, w[p + "norm.weight"], _get(norm, "epsilon", 1e-5), _get(norm, "activation", "silu"))
    return linear(y.reshape(length, heads * dim), w[p + "o_proj.weight"])


def mamba(x: np.ndarray, w: Weights, p: str, m: Config, hidden: int) -> np.ndarray:
    """§2.8 (Apriel-H1 "M1" Mamba): [z‖x‖B‖C] projection, x and B shared by ρ = D_in/D_xb heads of size N, conv
    before or after the repeat, Δ = softplus(dt_proj(dt_in_proj(x)) + b_dt) (the bias twice), a diagonal SSM per
    channel, y ⊙ silu(z)."""
    length = x.shape[0]
    d_in, d_xb, n, _, _ = _mamba_dims(m, hidden)
    rho = d_in // d_xb
    biased = bool(_get(m, "add_linear_biases", False))

    def maybe(key: str, enabled: bool) -> np.ndarray | None:
        return w[p + key] if enabled else None

    zxbc = linear(x, w[p + "in_proj.weight"], maybe("in_proj.bias", biased))  # step 1
    z = zxbc[:, :d_in]
    xs = zxbc[:, d_in: d_in + d_xb]
    b_flat = zxbc[:, d_in + d_xb: d_in + 2 * d_xb]
    c_flat = zxbc[:, d_in + 2 * d_xb:]
    # Channel c belongs to head h = ⌊c/N⌋, which reads x/B group ⌊h/ρ⌋ (steps 2-3).
    group_column = np.array([(c // n // rho) * n + c % n for c in range(d_in)])
    conv_bias = maybe("conv1d.bias", bool(m["conv_bias"]))
    if _get(m, "repeat_kv_before_conv", True):
        u = causal_conv1d_silu(xs[:, group_column], w[p + "conv1d.weight"], conv_bias)
    else:
        u = causal_conv1d_silu(xs, w[p + "conv1d.weight"], conv_bias)[:, group_column]
    dt_bias = maybe("dt_proj.bias", bool(m["dt_proj_bias"]))
    delta = linear(linear(x, w[p + "dt_in_proj.weight"], maybe("dt_in_proj.bias", biased)), w[p + "dt_proj.weight"],
                   dt_bias)  # step 4: already includes b_dt
    dt = softplus(delta + (0.0 if dt_bias is None else dt_bias))  # step 5: QUIRK, b_dt added a second time
    a = -np.exp(w[p + "A_log"])  # step 6, [D_in, N]
    y = np.zeros((length, d_in))
    state = np.zeros((d_in, n))
    for t in range(length):  # step 7
        for c in range(d_in):
            head, group = c // n, c // n // rho
            b_head = b_flat[t, group * n:(group + 1) * n]
            c_head = c_flat[t, head * n:(head + 1) * n]
            state[c] = np.exp(dt[t, c] * a[c]) * state[c] + dt[t, c] * u[t, c] * b_head
            y[t, c] = c_head @ state[c] + w[p + "D"][c] * u[t, c]
    y = y * silu(z)  # step 8
    return linear(y, w[p + "out_proj.weight"], maybe("out_proj.bias", biased))


def mlp(x: np.ndarray, w: Weights, p: str, m: Config) -> np.ndarray:
    """§2.2: gated act(x W_gᵀ) ⊙ x W_uᵀ → down (no biases); non-gated act(x W_uᵀ + b_u) W_dᵀ + b_d."""
    act = _get(m, "activation", "silu")
    if _get(m, "gated", True):
        return linear(activation(act, linear(x, w[p + "gate_proj.weight"])) * linear(x, w[p + "up_proj.weight"]),
                      w[p + "down_proj.weight"])
    default = bool(_get(m, "add_linear_biases", False))
    up_bias = w[p + "up_proj.bias"] if _bias(m, "layer_1", default) else None
    down_bias = w[p + "down_proj.bias"] if _bias(m, "layer_2", default) else None
    return linear(activation(act, linear(x, w[p + "up_proj.weight"], up_bias)), w[p + "down_proj.weight"], down_bias)


# ----------------------------------------------------------------------------------------------------------------
# The model (spec §2.1)


def load_checkpoint(directory: str) -> tuple[dict, dict[str, np.ndarray]]:
    """config.json and the weights of an HF checkpoint directory (``model.safetensors`` or a sharded index)."""
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, np.ndarray] = {}
    for name in files:
        weights.update(load_file(os.path.join(directory, name)))
    return config, weights


class SpecReference:
    """The spec's full-sequence forward in float64 over a config dict and a {checkpoint key: array} dict."""

    def __init__(self, config: Config, weights: Weights, *, check_shapes: bool = True):
        self.config = config
        self.weights = {k: np.asarray(v, np.float64) for k, v in weights.items()}
        if check_shapes:
            self._check_shapes()

    @classmethod
    def from_checkpoint(cls, directory: str, **kwargs: Any) -> "SpecReference":
        config, weights = load_checkpoint(directory)
        return cls(config, weights, **kwargs)

    def _check_shapes(self) -> None:
        """The weights hold exactly the spec's keys and shapes (a tied checkpoint may still carry an unused
        ``lm_head.weight``; vision keys are ignored, Appendix B)."""
        expected = parameter_shapes(self.config)
        found = {k: tuple(v.shape) for k, v in self.weights.items() if not k.startswith("model.vision_encoder.")}
        if _get(self.config, "tie_word_embeddings", False):
            found.pop("lm_head.weight", None)
        if found != expected:
            wrong = sorted(k for k in set(found) & set(expected) if found[k] != expected[k])
            raise ValueError(f"weights do not match the spec's table: missing {sorted(set(expected) - set(found))}, "
                             f"unexpected {sorted(set(found) - set(expected))}, mis-shaped "
                             f"{[(k, found[k], expected[k]) for k in wrong]}")

    def logits(self, input_ids: np.ndarray, placement: Placement = None) -> np.ndarray:
        """ids [T] -> logits [T, V]; ids [B, T] -> [B, T, V] (each row on its own, positions from 0)."""
        ids = np.asarray(input_ids)
        if ids.ndim == 2:
            return np.stack([self.logits(row, placement) for row in ids])
        config, w = self.config, self.weights
        hidden = config["hidden_size"]
        # QUIRK §2.1 / §1.3: every block norm (RMS or Layer) uses the head epsilon, not its own.
        eps = _get(_get(_get(config, "head"), "normalization"), "epsilon", 1e-5)
        names = _placement_names(config, placement)
        x = w["model.embed_tokens.weight"][ids]  # §2.1: no embedding scaling
        for i, block in enumerate(block_configs(config)):
            prefix = f"model.decoder.blocks.{i}."
            layer_norm_block = _get(_get(block, "normalization"), "type", "rms_norm") == "layer_norm"

            def norm(h: np.ndarray, name: str) -> np.ndarray:
                if layer_norm_block:
                    return layer_norm(h, w[f"{prefix}{name}.weight"], w[f"{prefix}{name}.bias"], eps)
                return rms_norm(h, w[f"{prefix}{name}.weight"], eps)

            mixer = _get(block, "mixer", {})
            mixer_prefix = prefix + "mixer."
            if names[i] is not None:  # §3.1: the active sub-mixer's own weights; norms and MLP are shared
                mixer, mixer_prefix = mixer["mixers"][names[i]], f"{mixer_prefix}mixers.{names[i]}."
            a = norm(x, "input_layernorm")
            kind = _get(mixer, "type", "attention")
            if kind == "attention":
                y = attention(a, w, mixer_prefix, mixer)
            elif kind == "gdn":
                y = gdn(a, w, mixer_prefix, mixer)
            elif kind == "kda":
                y = kda(a, w, mixer_prefix, mixer)
            elif kind == "mamba":
                y = mamba(a, w, mixer_prefix, mixer, hidden)
            else:
                raise ValueError(f"layer {i}: unknown mixer type {kind!r}")
            x = x + y
            x = x + mlp(norm(x, "post_attention_layernorm"), w, prefix + "mlp.", block["mlp"])
        x = rms_norm(x, w["model.norm.weight"], eps)
        head = w["model.embed_tokens.weight"] if _get(config, "tie_word_embeddings", False) else w["lm_head.weight"]
        return x @ head.T  # no bias, no soft-capping
