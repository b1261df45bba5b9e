import copy
import json

import pytest

from apriel2_jax.config import (
    AttentionConfig,
    ConfigError,
    GDNConfig,
    MambaConfig,
    StochasticConfig,
    load_config,
    parse_config,
)
from tests.helpers import tiny_config

_DELETE = object()


def _mutated(path: str, value):
    data = tiny_config()
    node = data
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return data


def test_tiny_hybrid_parses_every_mixer_kind():
    cfg = parse_config(tiny_config())
    kinds = [b.mixer.kind for b in cfg.blocks]
    assert kinds == ["attention", "gdn", "kda", "attention", "mamba", "stochastic"]
    assert cfg.blocks[3].mixer.window_size == 5 and cfg.blocks[0].mixer.window_size is None
    sup = cfg.blocks[5].mixer
    assert isinstance(sup, StochasticConfig) and sup.names == ("attention", "gdn") and sup.main_mixer_name == "attention"


def test_pattern_cycles_and_fixed_repeats():
    data = tiny_config()
    data["decoder"]["num_blocks"] = 8
    cfg = parse_config(data)
    assert [b.name for b in cfg.blocks] == ["attn", "gdn", "kda", "swa", "mamba", "super", "attn", "gdn"]
    fixed = tiny_config()
    fixed["decoder"] = {"type": "fixed", "num_blocks": 3, "block": data["decoder"]["blocks"]["gdn"]}
    cfg = parse_config(fixed)
    assert len(cfg.blocks) == 3 and all(isinstance(b.mixer, GDNConfig) for b in cfg.blocks)


def test_reference_quirks_are_reproduced():
    data = tiny_config()
    data["head"]["normalization"]["epsilon"] = 1e-6
    data["decoder"]["blocks"]["attn"]["normalization"]["epsilon"] = 1e-3
    mamba = data["decoder"]["blocks"]["mamba"]["mixer"]
    del mamba["state_size"]
    mamba["d_state"] = 8  # the reference ignores d_state and uses 16
    del mamba["dt_rank"]
    cfg = parse_config(data)
    # Block norms use the head epsilon (HF quirk), not the block's own.
    assert cfg.block_norm_epsilon == 1e-6 and cfg.blocks[0].normalization.epsilon == 1e-3
    m = cfg.blocks[4].mixer
    assert isinstance(m, MambaConfig) and m.state_size == 16 and m.dt_rank == 2  # ceil(32 / 16)


def test_defaults_and_bias_overrides():
    data = tiny_config()
    attn = data["decoder"]["blocks"]["attn"]["mixer"]
    del attn["head_groups"]
    attn["add_linear_biases"] = True
    attn["dense_layer"] = {"bias": {"enabled": False}}
    a = parse_config(data).blocks[0].mixer
    assert isinstance(a, AttentionConfig) and a.head_groups == a.heads
    assert (a.q_bias, a.k_bias, a.v_bias, a.o_bias) == (True, True, True, False)


@pytest.mark.parametrize(
    "path, value, expected_path",
    [
        ("decoder.blocks.swa.mixer.window_size", -3, None),
        ("decoder.blocks.swa.mixer.window_size", "8", None),
        ("decoder.blocks.attn.mixer.heads", "four", None),
        ("decoder.blocks.attn.mixer.head_groups", 3, None),
        ("decoder.blocks.attn.mixer.head_size", 7, None),
        ("decoder.blocks.attn.mixer.rotary", _DELETE, None),
        ("decoder.blocks.attn.mixer.rotary.type", "yarn", None),
        ("decoder.blocks.attn.mixer.rotary.theta", -1.0, None),
        ("decoder.blocks.attn.mixer.type", "sliding_window", None),
        ("decoder.blocks.attn.mixer.causal", False, None),
        ("decoder.blocks.gdn.mixer.convolution_layer.kernel_size", _DELETE, None),
        ("decoder.blocks.gdn.mixer.convolution_layer.activation", "gelu", None),
        ("decoder.blocks.gdn.mixer.key_heads", 3, None),
        ("decoder.blocks.gdn.mixer.norm_eps", 0, None),
        ("decoder.blocks.kda.mixer.normalization.activation", "tanh", None),
        ("decoder.blocks.kda.mixer.heads", 0, None),
        ("decoder.blocks.mamba.mixer.conv_bias", _DELETE, None),
        ("decoder.blocks.mamba.mixer.dt_proj_bias", "yes", None),
        ("decoder.blocks.mamba.mixer.d_inner", 60, None),
        ("decoder.blocks.mamba.mixer.d_xb", 24, None),
        ("decoder.blocks.mamba.mixer.repeat_kv_before_conv", 1, None),
        ("decoder.blocks.super.mixer.main_mixer_name", "kda", None),
        ("decoder.blocks.super.mixer.sampling_strategy", "full_layout", None),
        ("decoder.blocks.super.mixer.mixers.gdn.type", "stochastic", None),
        ("decoder.blocks.super.mixer.mixers", {}, None),
        ("decoder.blocks.attn.mlp.activation", "prelu", None),
        ("decoder.blocks.attn.mlp.intermediate_size", 0, None),
        ("decoder.blocks.attn.mlp.type", "moe", None),
        ("decoder.blocks.attn.normalization.type", "none", None),
        ("decoder.type", "grid", None),
        ("decoder.num_blocks", 0, None),
        ("decoder.pattern", ["attn", "nope"], "decoder.pattern[1]"),
        ("decoder.pattern", "attn", None),
        ("decoder", _DELETE, None),
        ("head.normalization.epsilon", -1e-5, None),
        ("head.normalization.type", "layer_norm", None),
        ("hidden_size", True, None),
        ("vocab_size", 0, None),
        ("model_type", "llama", None),
        ("tie_word_embeddings", "yes", None),
        ("eos_token_id", -2, None),
    ],
)
def test_malformed_field_names_its_path(path, value, expected_path):
    with pytest.raises(ConfigError) as info:
        parse_config(_mutated(path, value))
    err = info.value
    assert err.path == (expected_path or path)
    message = str(err)
    assert err.path in message and "expected" in message
    if value is not _DELETE and expected_path is None:
        assert repr(value) in message


def test_load_config_names_the_file(tmp_path):
    data = _mutated("decoder.blocks.swa.mixer.window_size", 0)
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_config(tmp_path / "nowhere")


def test_configs_are_immutable_and_hashable():
    cfg = parse_config(tiny_config())
    with pytest.raises(Exception):
        cfg.hidden_size = 8  # type: ignore[misc]
    assert hash(cfg) == hash(parse_config(copy.deepcopy(tiny_config())))


def test_shared_real_size_configs_parse():
    import os

    from tests.conftest import REPO

    root = os.path.join(REPO, "..", "shared", "configs")
    found = 0
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "config.json")
        if os.path.exists(path):
            cfg = load_config(path)
            assert cfg.num_blocks > 0
            found += 1
    assert found >= 2
