"""Test helpers: tiny configs and random checkpoints written in the HF format."""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import numpy as np
from safetensors.numpy import save_file

from apriel2_jax.checkpoint import expected_parameters
from apriel2_jax.config import parse_config

_MLP = {"type": "mlp", "intermediate_size": 48, "activation": "silu", "gated": True}
_NORM = {"type": "rms_norm", "epsilon": 1e-5}
_ROPE = {"type": "mistral_1d", "theta": 10000.0}

# Spec §1.4-style tiny hybrid, with a Mamba block and a supernet block added.
TINY_HYBRID = {
    "model_type": "apriel2_text",
    "architectures": ["Apriel2ForCausalLM"],
    "hidden_size": 32,
    "vocab_size": 64,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "embeddings": {"max_position_embeddings": 128},
    "head": {"normalization": {"type": "rms_norm", "epsilon": 1e-5}},
    "decoder": {
        "type": "pattern",
        "num_blocks": 6,
        "pattern": ["attn", "gdn", "kda", "swa", "mamba", "super"],
        "blocks": {
            "attn": {
                "mixer": {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 8, "rotary": _ROPE},
                "mlp": _MLP,
                "normalization": _NORM,
            },
            "gdn": {
                "mixer": {
                    "type": "gdn",
                    "value_heads": 4,
                    "key_heads": 2,
                    "key_head_dim": 8,
                    "value_head_dim": 8,
                    "convolution_layer": {"kernel_size": 4},
                },
                "mlp": _MLP,
                "normalization": _NORM,
            },
            "kda": {
                "mixer": {
                    "type": "kda",
                    "heads": 2,
                    "head_dim": 8,
                    "convolution_layer": {"kernel_size": 4},
                    "normalization": {"epsilon": 1e-5},
                },
                "mlp": _MLP,
                "normalization": _NORM,
            },
            "swa": {
                "mixer": {
                    "type": "attention",
                    "heads": 4,
                    "head_groups": 1,
                    "head_size": 8,
                    "window_size": 5,
                    "rotary": _ROPE,
                },
                "mlp": _MLP,
                "normalization": _NORM,
            },
            "mamba": {
                "mixer": {
                    "type": "mamba",
                    "d_inner": 64,
                    "d_xb": 16,
                    "state_size": 8,
                    "dt_rank": 4,
                    "d_conv": 4,
                    "repeat_kv_before_conv": True,
                    "conv_bias": True,
                    "dt_proj_bias": True,
                },
                "mlp": _MLP,
                "normalization": _NORM,
            },
            "super": {
                "mixer": {
                    "type": "stochastic",
                    "main_mixer_name": "attention",
                    "mixers": {
                        "attention": {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 8, "rotary": _ROPE},
                        "gdn": {
                            "type": "gdn",
                            "value_heads": 2,
                            "key_heads": 2,
                            "key_head_dim": 8,
                            "value_head_dim": 8,
                            "convolution_layer": {"kernel_size": 4},
                        },
                    },
                },
                "mlp": _MLP,
                "normalization": _NORM,
            },
        },
    },
}


def tiny_config(**overrides) -> dict:
    data = copy.deepcopy(TINY_HYBRID)
    data.update(overrides)
    return data


def random_weights(config_dict: dict, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Random tensors with exactly the keys and shapes the model expects for ``config_dict``."""
    rng = np.random.default_rng(seed)
    _, _, expected = expected_parameters(parse_config(config_dict))
    weights = {}
    for key, var in sorted(expected.items()):
        scale = 0.5 if key.endswith(("A_log", "dt_bias", "D")) else 0.2
        weights[key] = (scale * rng.standard_normal(var.shape)).astype(dtype)
    return weights


def write_checkpoint(directory: str, config_dict: dict, weights: dict[str, np.ndarray], shards: int = 1) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_dict, f)
    keys = sorted(weights)
    if shards == 1:
        save_file({k: weights[k] for k in keys}, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return directory
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: weights[k] for k in part}, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return directory


def golden_model(case_name: str):
    """(case, float32 model, step runner) of a golden case: engines built on them share compiled steps."""
    from apriel2_jax.checkpoint import load_model
    from apriel2_jax.engine.step import StepRunner
    from apriel2_jax.parity import load_case
    from tests.conftest import GOLDENS

    directory = os.path.join(GOLDENS, case_name)
    model = load_model(directory, "float32")
    return load_case(directory), model, StepRunner(model)


def load_script(name: str):
    """``scripts/NAME.py`` imported as a module (the scripts are not a package)."""
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
