"""The tensor-parallel split: which heads and rows each device holds (plain Python, no devices)."""

import numpy as np
import pytest

from apriel2_jax.config import parse_config
from apriel2_jax.sharding import (
    ShardingError,
    TensorShard,
    plan_tensor_parallel,
    read_shard,
    split_groups,
    split_heads,
)
from tests.helpers import tiny_config

_MLP = {"type": "mlp", "intermediate_size": 48, "activation": "silu", "gated": True}


def tiny_config_dict(mixer=None, **overrides) -> dict:
    """One layer of ``mixer`` (default: the tiny hybrid's attention)."""
    data = tiny_config(**overrides)
    block = data["decoder"]["blocks"]["attn"]
    if mixer is not None:
        block = dict(block, mixer=mixer)
    data["decoder"] = {"type": "fixed", "num_blocks": 1, "block": block}
    return data


def test_heads_split_evenly_pad_or_replicate():
    even = split_heads(8, 4)
    assert even.heads == ((0, 1), (2, 3), (4, 5), (6, 7)) and all(all(p) for p in even.primary)
    padded = split_heads(6, 4)  # 6 heads on 4 devices: two per device, the last two are zero heads
    assert padded.heads == ((0, 1), (2, 3), (4, 5), (-1, -1))
    assert padded.primary[3] == (False, False)
    few = split_heads(2, 4)  # fewer heads than devices: each head on two devices, counted once
    assert few.heads == ((0,), (0,), (1,), (1,))
    assert [p[0] for p in few.primary] == [True, False, True, False]


def test_groups_follow_their_heads():
    # GQA 32 heads / 8 groups on 4 devices: two whole groups per device.
    assert split_groups(split_heads(32, 4), 8).heads == ((0, 1), (2, 3), (4, 5), (6, 7))
    # 2 groups on 4 devices: each group replicated on the two devices whose heads read it.
    assert split_groups(split_heads(8, 4), 2).heads == ((0,), (0,), (1,), (1,))
    # 14 heads / 2 groups on 4 devices: device 1's heads 4..7 read groups 0,0,0,1, so every device gets one
    # group copy per head (padding heads read none).
    expanded = split_groups(split_heads(14, 4), 2)
    assert expanded.heads[1] == (0, 0, 0, 1) and expanded.heads[3] == (1, 1, -1, -1)


def test_gdn_projection_is_split_per_segment_not_contiguously():
    """vLLM's bug (spec §4): the flat [Q|K|V|Z] rows must be split per segment, keeping value head j with key
    head j // (H_v / H_k)."""
    data = tiny_config_dict(mixer={"type": "gdn", "value_heads": 4, "key_heads": 2, "key_head_dim": 3,
                                   "value_head_dim": 5, "convolution_layer": {"kernel_size": 4}})
    plan = plan_tensor_parallel(parse_config(data), 2)
    qkvz = plan.tensor("model.decoder.blocks.0.mixer.in_proj_qkvz.weight")
    rows = np.arange(2 * 2 * 3 + 2 * 4 * 5)[:, None]  # row r holds r
    device1 = read_shard(rows, qkvz, 1)[:, 0].tolist()
    q, k, v, z = range(0, 6), range(6, 12), range(12, 32), range(32, 52)
    assert device1 == list(q[3:6]) + list(k[3:6]) + list(v[10:20]) + list(z[10:20])
    local = plan.local_config.blocks[0].mixer
    assert (local.value_heads, local.key_heads) == (2, 1)
    ba = plan.tensor("model.decoder.blocks.0.mixer.in_proj_ba.weight")
    assert read_shard(np.arange(8)[:, None], ba, 1)[:, 0].tolist() == [2, 3, 6, 7]


def test_output_projection_of_a_replicated_head_is_counted_once():
    data = tiny_config_dict(mixer={"type": "attention", "heads": 2, "head_groups": 1, "head_size": 2,
                                   "rotary": {"type": "mistral_1d", "theta": 10000.0}})
    plan = plan_tensor_parallel(parse_config(data), 4)
    o_proj = plan.tensor("model.decoder.blocks.0.mixer.o_proj.weight")
    weight = np.arange(1, 5, dtype=np.float32)[None, :].repeat(3, axis=0)  # [hidden=3, heads*size=4]
    blocks = [read_shard(weight, o_proj, d) for d in range(4)]
    assert [b[0].tolist() for b in blocks] == [[1, 2], [0, 0], [3, 4], [0, 0]]
    q_proj = plan.tensor("model.decoder.blocks.0.mixer.q_proj.weight")
    assert [read_shard(np.arange(4)[:, None], q_proj, d)[:, 0].tolist() for d in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_vocabulary_is_padded_to_the_mesh():
    plan = plan_tensor_parallel(parse_config(tiny_config_dict(vocab_size=10)), 4)
    embed = plan.tensor("model.embed_tokens.weight")
    table = np.arange(10, dtype=np.float32)[:, None]
    assert plan.local_config.vocab_size == 3
    assert read_shard(table, embed, 3)[:, 0].tolist() == [9, 0, 0]


def test_replicated_tensors_and_errors():
    plan = plan_tensor_parallel(parse_config(tiny_config_dict()), 2)
    assert plan.tensor("model.decoder.blocks.0.input_layernorm.weight") == TensorShard(None)
    with pytest.raises(ShardingError, match="tensor_parallel must be an integer >= 1"):
        plan_tensor_parallel(parse_config(tiny_config_dict()), 0)
    with pytest.raises(ShardingError, match="vocab_size 10 is smaller than tensor_parallel=16"):
        plan_tensor_parallel(parse_config(tiny_config_dict(vocab_size=10)), 16)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_superapriel_15b_splits_evenly_up_to_eight(tp):
    """32 query / 8 KV heads, GDN 32 value / 8 key heads, KDA 32 heads, MLP 14336: no padding, no copies."""
    import os

    from apriel2_jax.config import load_config
    from tests.conftest import REPO

    configs = os.path.join(REPO, "..", "shared", "configs")
    plan = plan_tensor_parallel(load_config(os.path.join(configs, "superapriel-15b-shaped")), tp)
    mixers = dict(plan.local_config.blocks[0].mixer.mixers)
    assert (mixers["attention"].heads, mixers["attention"].head_groups) == (32 // tp, 8 // tp)
    assert (mixers["gdn"].value_heads, mixers["gdn"].key_heads) == (32 // tp, 8 // tp)
    assert mixers["kda"].heads == 32 // tp
    assert plan.local_config.blocks[0].mlp.intermediate_size == 14336 // tp
    for key, shard in plan.tensors.items():
        assert all(start is not None for start, _ in shard.pieces(tp - 1)), key  # no zero padding anywhere
