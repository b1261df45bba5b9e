import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from apriel2_jax.checkpoint import CheckpointError, load_model
from apriel2_jax.placement import resolve_placement
from apriel2_jax.runner import ModelRunner
from tests.helpers import random_weights, tiny_config, write_checkpoint

IDS = np.array([[3, 17, 5, 60, 2, 9, 41, 8, 33]], np.int32)


def _logits(model, placement=None):
    return np.asarray(ModelRunner(model).forward(IDS, resolve_placement(model.config, placement)), np.float32)


def test_missing_extra_and_misshaped_tensors_are_reported_together(tmp_path):
    config = tiny_config()
    weights = random_weights(config)
    del weights["model.decoder.blocks.1.mixer.A_log"]
    weights["model.decoder.blocks.0.mixer.q_gate.weight"] = np.zeros((4, 4), np.float32)
    weights["model.decoder.blocks.2.mixer.q_proj.weight"] = np.zeros((16, 31), np.float32)
    write_checkpoint(str(tmp_path), config, weights)
    with pytest.raises(CheckpointError) as info:
        load_model(tmp_path)
    message = str(info.value)
    assert "missing (1)" in message and "model.decoder.blocks.1.mixer.A_log" in message
    assert "unexpected (1)" in message and "model.decoder.blocks.0.mixer.q_gate.weight" in message
    assert "wrong shape (1)" in message and "blocks.2.mixer.q_proj.weight (in model.safetensors): checkpoint [16, 31], model expects [16, 32]" in message


def test_sharded_checkpoint_equals_single_file(tmp_path):
    config = tiny_config()
    weights = random_weights(config, seed=1)
    single = load_model(write_checkpoint(str(tmp_path / "single"), config, weights))
    sharded = load_model(write_checkpoint(str(tmp_path / "sharded"), config, weights, shards=3))
    assert len([f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]) == 3
    np.testing.assert_array_equal(_logits(single), _logits(sharded))
    np.testing.assert_array_equal(_logits(single, ["attention", "gdn", "kda", None, None, "gdn"]), _logits(sharded, [None] * 5 + ["gdn"]))


def test_index_pointing_to_missing_shard_is_an_error(tmp_path):
    config = tiny_config()
    write_checkpoint(str(tmp_path), config, random_weights(config), shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    os.remove(tmp_path / first)
    with pytest.raises(CheckpointError, match=first):
        load_model(tmp_path)


def test_no_weights_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(tmp_path)


def test_tied_embeddings_use_the_embedding_matrix(tmp_path):
    config = tiny_config(tie_word_embeddings=True)
    weights = random_weights(config, seed=2)
    assert "lm_head.weight" not in weights
    model = load_model(write_checkpoint(str(tmp_path), config, weights))
    assert model.lm_head is None
    untied = tiny_config()
    untied_weights = dict(weights, **{"lm_head.weight": weights["model.embed_tokens.weight"]})
    reference = load_model(write_checkpoint(str(tmp_path / "untied"), untied, untied_weights))
    np.testing.assert_allclose(_logits(model), _logits(reference), rtol=1e-6, atol=1e-6)


def test_vision_keys_are_ignored(tmp_path):
    config = tiny_config()
    weights = random_weights(config, seed=3)
    weights["model.vision_encoder.embeddings.patch_embeddings.weight"] = np.zeros((4, 3, 2, 2), np.float32)
    load_model(write_checkpoint(str(tmp_path), config, weights))


def test_bfloat16_checkpoint_and_dtype_policy(tmp_path):
    config = tiny_config()
    weights32 = random_weights(config, seed=4)
    weights16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in weights32.items()}
    model = load_model(write_checkpoint(str(tmp_path), config, weights16), dtype="bfloat16")
    blocks = model.model.decoder.blocks
    assert blocks[0].mixer.q_proj.weight[...].dtype == jnp.bfloat16
    # Gate parameters stay fp32 (spec §8), whatever the model dtype.
    assert blocks[1].mixer.A_log[...].dtype == jnp.float32 and blocks[2].mixer.dt_bias[...].dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(blocks[0].mixer.q_proj.weight[...]), weights16["model.decoder.blocks.0.mixer.q_proj.weight"]
    )
    # The same bf16 weights loaded as fp32 give close logits.
    model32 = load_model(tmp_path, dtype="float32")
    a, b = _logits(model), _logits(model32)
    assert np.abs(a - b).max() < 0.05 * np.abs(b).max()
    with pytest.raises(ValueError, match="dtype"):
        load_model(tmp_path, dtype="int8")


def test_truncated_file_is_an_error(tmp_path):
    config = tiny_config()
    write_checkpoint(str(tmp_path), config, random_weights(config))
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(tmp_path)
