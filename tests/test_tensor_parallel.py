"""Tensor parallelism on virtual CPU devices (tests/conftest.py makes eight): every golden case and placement
gives the same greedy tokens at TP 2 and 4 as on one device, and float32 logits within the parity tolerance of
both the one-device model and the PyTorch goldens, with each device holding only its own rows of every tensor.

Sharding splits the contractions, so partial sums are added in another order: on CPU that moves float32 logits
(scale 10-45) by up to 1.8e-4 from one device, the same order as one device's own distance from the goldens
(up to 1.2e-4; both measured 2026-11-25, and the exact figure depends on the CPU's vector width). A sharding
bug moves them by O(1), so the parity tolerance separates the two."""

import os

import jax
import numpy as np
import pytest

from apriel2_jax.checkpoint import load_model
from apriel2_jax.engine.llm import LLM
from apriel2_jax.engine.sampling import SamplingParams
from apriel2_jax.engine.step import Buckets
from apriel2_jax.parity import FLOAT32_TOLERANCE, load_case
from apriel2_jax.placement import resolve_placement
from apriel2_jax.safetensors_io import index_checkpoint, read_tensor
from apriel2_jax.sharding import AXIS, ShardingError, read_shard
from apriel2_jax.tensor_parallel import random_sharded, shard_model
from tests.conftest import GOLDENS, golden_cases
from tests.engine.test_llm import GREEDY, SMALL, _prompts

TP_SIZES = (2, 4)


@pytest.fixture(scope="module")
def single_device_models():
    return {name: load_model(os.path.join(GOLDENS, name), "float32") for name in golden_cases()}


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("case_name", golden_cases())
def test_logits_and_greedy_tokens_equal_one_device(case_name, tp, single_device_models):
    directory = os.path.join(GOLDENS, case_name)
    case = load_case(directory)
    reference = single_device_models[case_name]
    sharded = load_model(directory, "float32", tensor_parallel=tp)
    assert sharded.mesh.shape == {AXIS: tp}
    llm = LLM(model=sharded, dtype="float32", buckets=Buckets((2,), (2,), (8,)), debug_checks=True,
              placements=case.placements, **SMALL)
    ids = np.asarray(case.input_ids[:, : case.prompt_len + 4], np.int32)
    for name in case.placements:
        placement = resolve_placement(reference.config, name, case.placements)
        want = np.asarray(jax.jit(lambda x: reference(x, placement)[0])(ids))
        got = np.asarray(sharded.forward(ids, placement))
        np.testing.assert_allclose(got, want, rtol=0, atol=FLOAT32_TOLERANCE, err_msg=f"{case_name}/{name} tp={tp}")
        np.testing.assert_allclose(
            got, case.logits[name][:, : ids.shape[1]], rtol=0, atol=FLOAT32_TOLERANCE,
            err_msg=f"{case_name}/{name} tp={tp} vs goldens",
        )

        llm.set_placement(name)
        outputs = llm.generate(_prompts(case), GREEDY)
        np.testing.assert_array_equal(
            np.array([o.token_ids for o in outputs]), case.greedy_ids[name], err_msg=f"{case_name}/{name} tp={tp}"
        )
        assert all(usage[0] == 0 for usage in llm.cache_manager.usage().values())


def test_each_device_holds_only_its_rows():
    directory = os.path.join(GOLDENS, "hybrid_all_mixers")
    sharded = load_model(directory, "float32", tensor_parallel=4)
    found = index_checkpoint(directory)
    for key, leaf, spec in zip(sharded.keys, sharded.param_leaves, sharded.param_specs):
        shard = sharded.plan.tensor(key)
        source = read_tensor(found[key])
        for device_shard in leaf.addressable_shards:
            d = list(sharded.mesh.devices.flat).index(device_shard.device)
            block = np.asarray(device_shard.data)
            if shard.axis is None:
                assert spec == jax.sharding.PartitionSpec() and block.shape == source.shape, key
            else:
                assert block.shape[shard.axis] == leaf.shape[shard.axis] // 4, key
            np.testing.assert_array_equal(block, read_shard(source, shard, d), err_msg=key)


def test_caches_are_split_like_their_heads():
    directory = os.path.join(GOLDENS, "hybrid_all_mixers")
    case = load_case(directory)
    llm = LLM(directory, dtype="float32", tensor_parallel=2, placements=case.placements, placement="mamba", **SMALL)
    single = LLM(directory, dtype="float32", placements=case.placements, placement="mamba", **SMALL)
    for layer, (split, whole) in enumerate(zip(llm._cache, single._cache)):
        for name, array in split.items():
            axis = {"k": 2, "v": 2, "ssm": 1}.get(name, 2)
            assert array.addressable_shards[0].data.shape[axis] * 2 == array.shape[axis], (layer, name)
            assert array.shape[axis] >= whole[name].shape[axis], (layer, name)
    # The budget is per device and each device holds half of every page: at least as many pages as one device.
    assert all(llm.plan.pages[f] >= single.plan.pages[f] for f in single.plan.pages)


def test_prefix_caching_with_split_caches():
    """Snapshots are copied within each device's share of the state arrays: the same tokens as one device
    without caching, every restore used, and every cache array keeps its sharding."""
    from tests.engine.test_prefix_cache import ENGINE, _run, _shared_prefix_prompts

    directory = os.path.join(GOLDENS, "hybrid_all_mixers")
    case = load_case(directory)
    prompts = _shared_prefix_prompts(case)
    plain = LLM(directory, placements=case.placements, placement="mamba", enable_prefix_caching=False, **ENGINE)
    split = LLM(directory, tensor_parallel=2, placements=case.placements, placement="mamba", **ENGINE)
    shardings = [a.sharding for a in jax.tree.leaves(split._cache)]
    assert _run(split, prompts) == _run(plain, prompts)
    assert split.stats.prefix.snapshots_restored > 0
    assert [a.sharding for a in jax.tree.leaves(split._cache)] == shardings


def test_chained_decode_dispatches_with_split_caches():
    """A dispatch chained onto the previous one reads its carry (replicated over the mesh) inside shard_map: the
    same tokens as one device, one dispatch at a time, and no step compiled beyond the warm-up (a dispatch with no
    previous one gets a placeholder placed like a dispatch's outputs)."""
    directory = os.path.join(GOLDENS, "hybrid_all_mixers")
    case = load_case(directory)
    engine = dict(SMALL, placements=case.placements, placement="mamba", dtype="float32", decode_steps=2,
                  buckets=Buckets((2,), (2,), (8,)))
    plain = LLM(directory, chain_decode=False, **engine)
    split = LLM(directory, tensor_parallel=2, debug_checks=True, **dict(engine, warm_up="few"))
    split.generate(_prompts(case)[:1], SamplingParams.greedy(max_new_tokens=1))  # compiles the prefill shape
    compiled = split.runner.compilations
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_new_tokens=8)]  # no top-k: no new sampler variant
    want = [o.token_ids for o in plain.generate(_prompts(case), params)]
    assert [o.token_ids for o in split.generate(_prompts(case), params)] == want
    assert split.stats.chained_dispatches > 0
    assert split.runner.compilations == compiled


def test_in_memory_model_can_be_split_and_random_sharded_models_run():
    directory = os.path.join(GOLDENS, "supernet_swa")
    case = load_case(directory)
    model = load_model(directory, "float32")
    sharded = shard_model(model, 2)
    placement = resolve_placement(model.config, "mixed", case.placements)
    ids = np.asarray(case.input_ids[:, : case.prompt_len], np.int32)
    want = np.asarray(model(ids, placement)[0])
    np.testing.assert_allclose(np.asarray(sharded.forward(ids, placement)), want, atol=FLOAT32_TOLERANCE, rtol=0)
    random = random_sharded(model.config, 2, dtype=np.float32, seed=1)
    logits = np.asarray(random.forward(ids, placement))
    assert logits.shape == want.shape and np.isfinite(logits).all()


def test_too_many_devices_is_a_clear_error():
    with pytest.raises(ShardingError, match="tensor_parallel=64 needs 64 devices, but 8 are visible"):
        load_model(os.path.join(GOLDENS, "supernet_swa"), "float32", tensor_parallel=64)


@pytest.mark.parametrize("supernet", [False, True])
def test_conv_kernel_of_one_is_refused_at_tensor_parallel(supernet):
    """Its empty conv state would crash XLA compiling the split step (the process dies), so LLM refuses it."""
    from apriel2_jax.config import parse_config
    from tests.helpers import tiny_config

    config = tiny_config()
    blocks = config["decoder"]["blocks"]
    if supernet:
        blocks["super"]["mixer"]["mixers"]["gdn"]["convolution_layer"]["kernel_size"] = 1
    else:
        blocks["mamba"]["mixer"]["d_conv"] = 1
    model = random_sharded(parse_config(config), 2, dtype=np.float32)
    where = "layer 5 mixer 'gdn'" if supernet else "layer 4"
    with pytest.raises(ShardingError, match=f"{where}: a convolution of kernel size 1 .* tensor_parallel=1"):
        LLM(model=model, **SMALL)


def test_command_lines_take_tensor_parallel(tmp_path, capsys):
    """apriel2-generate on a converted --tp 2 checkpoint and check_parity with --tensor-parallel 2."""
    import json

    from apriel2_jax.cli.check_parity import main as check_parity
    from apriel2_jax.cli.generate import main as generate
    from convert.cli import main as convert

    directory = os.path.join(GOLDENS, "supernet_swa")
    case = load_case(directory)
    assert check_parity([directory, "--placement", "mixed", "--tensor-parallel", "2"]) == 0
    report = capsys.readouterr().out
    assert "tensor parallel 2" in report and "greedy" in report and "FAIL" not in report

    assert convert([directory, str(tmp_path / "tp2"), "--tp", "2"]) == 0
    argv = ["--placement", "mixed", "--max-new-tokens", "8", "--ignore-eos", "--json", "--dtype", "float32",
            "--warm-up", "none", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]
    for row in _prompts(case):
        argv += ["--prompt-ids", ",".join(map(str, row))]
    capsys.readouterr()
    assert generate([str(tmp_path / "tp2"), "--tensor-parallel", "2", *argv]) == 0
    tokens = [r["token_ids"] for r in json.loads(capsys.readouterr().out)]
    np.testing.assert_array_equal(tokens, case.greedy_ids["mixed"])
    assert generate([str(tmp_path / "tp2"), *argv]) == 2  # converted for two devices, loaded on one
    assert "converted for tensor_parallel=2" in capsys.readouterr().err


@pytest.mark.parametrize("case_name", golden_cases())
def test_eight_devices_give_the_same_logits(case_name, single_device_models):
    """TP=8 (the largest single-host mesh): more devices than most goldens' heads, so heads are replicated or
    padded. Summing eight partial products in another order moves fp32 logits by about as much as TP 2 and 4 do
    (1.1e-4 on supernet_fixed all_gdn on one CPU), so the bound is the goldens' own tolerance."""
    directory = os.path.join(GOLDENS, case_name)
    case = load_case(directory)
    reference = single_device_models[case_name]
    sharded = shard_model(reference, 8)
    ids = np.asarray(case.input_ids[:, : case.prompt_len], np.int32)
    for name in case.placements:
        placement = resolve_placement(reference.config, name, case.placements)
        want = np.asarray(jax.jit(lambda x: reference(x, placement)[0])(ids))
        np.testing.assert_allclose(np.asarray(sharded.forward(ids, placement)), want, rtol=0, atol=FLOAT32_TOLERANCE,
                                   err_msg=f"{case_name}/{name}")
