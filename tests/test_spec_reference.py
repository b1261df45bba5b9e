"""The float32 JAX model against ``tests/spec_reference.py``, an independent float64 NumPy re-derivation of the
spec's forward pass, on config variants the golden checkpoints do not cover.

First the oracle itself is checked: it reproduces every golden case's logits (written by the PyTorch reference) for
every placement. Then, for each variant model below (tiny random checkpoints in the HF format):
  * the spec's parameter table equals the keys and shapes the loader expects;
  * our full forward (``ModelRunner.forward``) matches the reference logits;
  * our cached path (a prefill of the prompt, then one-token decode steps) matches them at every position;
  * each config feature the variant exercises moves the reference logits by far more than the tolerance, so a
    model that ignored it would fail the comparisons above;
  * the model split by tensor parallelism over 2 and 3 devices (uneven head splits) matches them too, and the
    engine at TP=2 on the hybrid variant follows the reference's greedy continuation (section (c)).

Tolerance: ``RTOL * max(1, max |reference logit|)`` with RTOL = 1e-4. Measured 2026-11-30 on the CPU:
  * the reference against the goldens (float32 PyTorch outputs): at most 3.8e-6 of scale (hybrid_all_mixers/mamba,
    4.3e-5 on a scale of 11.2); 1.05e-4 absolute on supernet_fixed/every2_kda, whose scale is 44.9;
  * our float32 model against the reference, max abs error (forward / prefill / decode positions) on logit scales of
    3.3-4.9: norms_mlps_attention 1.4e-6 / 1.7e-6 / 1.0e-6, attention_windows 2.8e-6 / 2.5e-6 / 2.2e-6,
    gdn_heads_kernels 1.4e-5 / 1.3e-5 / 9.7e-6, kda_kernels_sigmoid 2.3e-5 / 2.3e-5 / 3.9e-6,
    mamba_biases_defaults 1.6e-5 / 1.2e-5 / 6.4e-6, long_hybrid_over_chunks 3.9e-5 / 3.9e-5 / 4.4e-6; the worst is
    8.2e-6 of scale, 12x inside the tolerance;
  * the smallest feature effect in the mutation test is 259x the tolerance (RoPE theta 1e6 read as 1e4), the others
    1000x or more.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from typing import Any, Callable

import numpy as np
import pytest
from safetensors.numpy import load_file

from apriel2_jax.checkpoint import expected_parameters, load_model
from apriel2_jax.config import parse_config
from apriel2_jax.engine.llm import LLM
from apriel2_jax.engine.sampling import SamplingParams
from apriel2_jax.engine.step import Buckets
from apriel2_jax.placement import load_placements, resolve_placement
from apriel2_jax.runner import ModelRunner
from apriel2_jax.sharding import AXIS, plan_tensor_parallel
from apriel2_jax.tensor_parallel import ShardedModel
from tests.conftest import GOLDENS, golden_cases
from tests.helpers import random_weights, tiny_config, write_checkpoint
from tests.spec_reference import SpecReference, parameter_shapes

RTOL = 1e-4
BATCH = 2


def tolerance(reference: np.ndarray) -> float:
    return RTOL * max(1.0, float(np.abs(reference).max()))


# ----------------------------------------------------------------------------------------------------------------
# (a) The reference against the goldens


def _golden_pairs() -> list[tuple[str, str]]:
    return [(case, name) for case in golden_cases() for name in load_placements(os.path.join(GOLDENS, case))]


@functools.cache
def _golden(case: str) -> tuple[SpecReference, dict[str, np.ndarray], dict]:
    """(reference over the case's checkpoint, golden.safetensors tensors, placements.json)."""
    directory = os.path.join(GOLDENS, case)
    golden = load_file(os.path.join(directory, "golden.safetensors"))
    return SpecReference.from_checkpoint(directory), golden, load_placements(directory)


@pytest.mark.parametrize("case, placement", _golden_pairs())
def test_reference_reproduces_golden_logits(case, placement):
    """Full-sequence logits of both golden rows at every position (measured: within 3.8e-6 of scale)."""
    ref, golden, placements = _golden(case)
    expected = golden[f"{placement}.logits"]
    ours = ref.logits(golden["input_ids"], placements[placement])
    assert ours.shape == expected.shape
    error = float(np.abs(ours - expected).max())
    scale = float(np.abs(expected).max())
    assert error <= tolerance(expected), f"{case}/{placement}: max error {error:.3e}, logit scale {scale:.1f}"


# ----------------------------------------------------------------------------------------------------------------
# (b) Variants: our model against the reference

_ROPE = {"type": "mistral_1d", "theta": 10000.0}
_GATED = {"type": "mlp", "intermediate_size": 40, "activation": "silu", "gated": True}
_RMS = {"type": "rms_norm", "epsilon": 1e-5}


def _attention(heads: int = 4, head_groups: int | None = 2, head_size: int = 8, **extra) -> dict:
    mixer = {"type": "attention", "heads": heads, "head_size": head_size, "rotary": dict(_ROPE), **extra}
    if head_groups is not None:
        mixer["head_groups"] = head_groups
    return mixer


def _gdn(value_heads: int, key_heads: int, key_head_dim: int, value_head_dim: int, kernel: int, **extra) -> dict:
    return {"type": "gdn", "value_heads": value_heads, "key_heads": key_heads, "key_head_dim": key_head_dim,
            "value_head_dim": value_head_dim, "convolution_layer": {"kernel_size": kernel}, **extra}


def _kda(heads: int, head_dim: int, kernel: int | None, **extra) -> dict:
    mixer = {"type": "kda", "heads": heads, "head_dim": head_dim, **extra}
    if kernel is not None:
        mixer["convolution_layer"] = {"kernel_size": kernel}
    return mixer


def _mamba(**fields) -> dict:
    return {"type": "mamba", **fields}


def _block(mixer: dict, mlp: dict | None = None, norm: dict | None = None) -> dict:
    return {"mixer": mixer, "mlp": copy.deepcopy(mlp or _GATED), "normalization": dict(norm or _RMS)}


def _model(blocks: dict[str, dict], hidden: int = 32, vocab: int = 64, **top) -> dict:
    """A pattern decoder with one layer per named block, in order, on top of ``tests.helpers.tiny_config``."""
    decoder = {"type": "pattern", "num_blocks": len(blocks), "pattern": list(blocks), "blocks": blocks}
    return tiny_config(hidden_size=hidden, vocab_size=vocab, decoder=decoder, **top)


Mutation = Callable[[dict], None]


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    config: dict
    length: int = 40  # tokens per row
    prompt: int = 29  # prefilled at once; the rest are one-token decode steps
    placement: Any = None
    # Config edits that keep the weights valid, each the absence (or the other value) of a feature the variant
    # exercises: the reference logits must move by well over the tolerance when one is applied.
    mutations: dict[str, Mutation] = dataclasses.field(default_factory=dict)


def _blocks(config: dict) -> dict:
    return config["decoder"]["blocks"]


def _set(block: str, path: str, value) -> Mutation:
    """A mutation setting ``decoder.blocks[block].<path>`` (dotted) to ``value`` (None deletes it)."""

    def apply(config: dict) -> None:
        node = _blocks(config)[block]
        *parents, key = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(key, None)
        else:
            node[key] = value

    return apply


def _set_head_eps(value: float) -> Mutation:
    def apply(config: dict) -> None:
        config["head"]["normalization"]["epsilon"] = value

    return apply


VARIANTS = [
    # Norms, MLPs, attention geometry and biases, tied embeddings; attention only.
    Variant(
        "norms_mlps_attention",
        _model(
            {
                # layer_norm block; non-gated gelu MLP with only layer_1's bias; MHA (head_groups absent) of 5 x 6
                "ln_gelu": _block(
                    _attention(heads=5, head_groups=None, head_size=6, rotary={"type": "mistral_1d", "theta": 1e6}),
                    {"type": "mlp", "intermediate_size": 24, "activation": "gelu", "gated": False,
                     "layer_1": {"bias": {"enabled": True}}},
                    {"type": "layer_norm", "epsilon": 1e-6}),
                # layer_norm; non-gated relu, add_linear_biases with layer_1 turned off; GQA 6:1, Qwen-style biases
                "ln_relu": _block(
                    _attention(heads=6, head_groups=1, head_size=10, add_linear_biases=True,
                               dense_layer={"bias": {"enabled": False}}),
                    {"type": "mlp", "intermediate_size": 24, "activation": "relu", "gated": False,
                     "add_linear_biases": True, "layer_1": {"bias": {"enabled": False}}},
                    {"type": "layer_norm", "epsilon": 1e-6}),
                # gated gelu_pytorch_tanh whose add_linear_biases the reference ignores; only o_proj biased
                "rms_tanh": _block(
                    _attention(dense_layer={"bias": {"enabled": True}}),
                    {"type": "mlp", "intermediate_size": 40, "activation": "gelu_pytorch_tanh", "gated": True,
                     "add_linear_biases": True},
                    {"type": "rms_norm", "epsilon": 1e-6}),
                # gated relu; GQA 6:3 with head_size 4
                "rms_relu": _block(
                    _attention(heads=6, head_groups=3, head_size=4),
                    {"type": "mlp", "intermediate_size": 40, "activation": "relu", "gated": True},
                    {"type": "rms_norm", "epsilon": 1e-6}),
            },
            # The block epsilons (1e-6) are ignored: every norm uses the head's 0.1 (spec §2.1).
            head={"normalization": {"type": "rms_norm", "epsilon": 0.1}},
            tie_word_embeddings=True,
        ),
        mutations={
            "block norms use their own eps": _set_head_eps(1e-6),
            "layer_norm read as rms_norm": _set("ln_gelu", "normalization.type", "rms_norm"),
            "gelu read as silu": _set("ln_gelu", "mlp.activation", "silu"),
            "gelu_pytorch_tanh read as silu": _set("rms_tanh", "mlp.activation", "silu"),
            "relu read as silu": _set("rms_relu", "mlp.activation", "silu"),
            "no layer_1 bias": _set("ln_gelu", "mlp.layer_1", None),
            "no layer_2 bias": _set("ln_relu", "mlp.add_linear_biases", False),
            "no q/k/v biases": _set("ln_relu", "mixer.add_linear_biases", False),
            "no o_proj bias": _set("rms_tanh", "mixer.dense_layer", None),
            "rope theta 1e4 for 1e6": _set("ln_gelu", "mixer.rotary.theta", 1e4),
        },
    ),
    # Sliding windows of 1, 3 and 7 (shorter than the prompt) and 100 (longer than the sequence), with full
    # attention after them; MHA, GQA 2:1 and 2:1-with-one-group heads.
    Variant(
        "attention_windows",
        _model({
            "w1": _block(_attention(window_size=1)),
            "w3": _block(_attention(head_groups=4, window_size=3)),
            "w7": _block(_attention(heads=2, head_groups=1, window_size=7)),
            "w100": _block(_attention(window_size=100)),
            "full": _block(_attention()),
        }),
        mutations={
            "window 1 read as full": _set("w1", "mixer.window_size", None),
            "window 3 read as 4": _set("w3", "mixer.window_size", 4),
            "window 7 read as 6": _set("w7", "mixer.window_size", 6),
        },
    ),
    # GDN: 3 and 4 value heads per key head, key_head_dim != value_head_dim, norm_eps, kernel sizes 2/5/3/1.
    Variant(
        "gdn_heads_kernels",
        _model({
            "r3_k2": _block(_gdn(6, 2, 6, 10, 2)),
            "r4_k5": _block(_gdn(4, 1, 12, 4, 5, norm_eps=1e-2)),
            "r1_k3": _block(_gdn(3, 3, 8, 8, 3)),
            "r2_k1": _block(_gdn(4, 2, 8, 8, 1)),
        }),
        mutations={"norm_eps 1e-2 read as 1e-5": _set("r4_k5", "mixer.norm_eps", None)},
    ),
    # KDA: sigmoid output-gate activation, its own epsilon, no convolution_layer (kernel 4), kernel sizes
    # 3/5/1/2; the 33-token prompt spans three chunks of 16.
    Variant(
        "kda_kernels_sigmoid",
        _model({
            "sigmoid_k3": _block(_kda(3, 12, 3, normalization={"epsilon": 1e-3, "activation": "sigmoid"})),
            "default_k4": _block(_kda(1, 20, None)),
            "k5": _block(_kda(4, 4, 5, normalization={"epsilon": 1e-5})),
            "k1": _block(_kda(2, 8, 1)),
            "k2": _block(_kda(2, 6, 2)),
        }),
        prompt=33,
        mutations={
            "sigmoid read as silu": _set("sigmoid_k3", "mixer.normalization.activation", "silu"),
            "epsilon 1e-3 read as 1e-5": _set("sigmoid_k3", "mixer.normalization.epsilon", 1e-5),
        },
    ),
    # Mamba: no conv/dt_proj biases with d_xb = d_inner; add_linear_biases, conv after the repeat and dt_rank
    # "auto"; expand without d_inner, d_xb and dt_rank absent; d_state (ignored: N = 16); kernels 2/3/5/1. The
    # 33-token prompt spans two chunks of 32.
    Variant(
        "mamba_biases_defaults",
        _model({
            "no_biases": _block(_mamba(d_inner=32, d_xb=32, state_size=8, dt_rank=4, d_conv=2, conv_bias=False,
                                       dt_proj_bias=False)),
            "linear_biases": _block(_mamba(d_inner=64, d_xb=16, state_size=8, dt_rank="auto", d_conv=3,
                                           repeat_kv_before_conv=False, add_linear_biases=True, conv_bias=True,
                                           dt_proj_bias=True)),
            "expand": _block(_mamba(expand=1, state_size=4, d_conv=5, conv_bias=True, dt_proj_bias=True)),
            "d_state": _block(_mamba(d_inner=64, d_xb=32, d_state=8, d_conv=1, conv_bias=False, dt_proj_bias=True)),
        }),
        prompt=33,
        mutations={
            "no linear biases": _set("linear_biases", "mixer.add_linear_biases", False),
            "no conv bias": _set("linear_biases", "mixer.conv_bias", False),
            "no dt_proj bias": _set("expand", "mixer.dt_proj_bias", False),
        },
    ),
    # Every recurrent mixer over a prompt longer than its chunk (GDN 64, KDA 16, Mamba 32) and a window (20),
    # with a supernet layer running a sub-mixer other than its main one.
    Variant(
        "long_hybrid_over_chunks",
        _model({
            "gdn": _block(_gdn(4, 2, 8, 8, 4)),
            "kda": _block(_kda(2, 8, 4)),
            "mamba": _block(_mamba(d_inner=64, d_xb=16, state_size=8, dt_rank=4, d_conv=4, conv_bias=True,
                                   dt_proj_bias=True)),
            "swa": _block(_attention(window_size=20)),
            "super": _block({"type": "stochastic", "main_mixer_name": "attention",
                             "mixers": {"attention": _attention(), "gdn": _gdn(2, 2, 8, 8, 4)}}),
        }),
        length=72,
        prompt=68,
        placement={"4": "gdn"},
        mutations={"window 20 read as full": _set("swa", "mixer.window_size", None)},
    ),
]


def _weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """``random_weights`` with norm weights near 1, so that every layer's output reaches the logits."""
    weights = random_weights(config, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for key, value in weights.items():
        if key.endswith("norm.weight"):
            weights[key] = (1.0 + 0.3 * rng.standard_normal(value.shape)).astype(np.float32)
    return weights


@dataclasses.dataclass
class VariantCase:
    variant: Variant
    directory: str  # the checkpoint
    weights: dict[str, np.ndarray]
    ids: np.ndarray  # [B, T]
    reference: np.ndarray  # [B, T, V] float64


@dataclasses.dataclass
class VariantRun:
    case: VariantCase
    forward: np.ndarray  # ours, full forward
    cached: np.ndarray  # ours, prefill then decode steps


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: v.name)
def variant_case(request, tmp_path_factory) -> VariantCase:
    """The variant's checkpoint, token ids and reference logits (no JAX)."""
    variant: Variant = request.param
    seed = VARIANTS.index(variant)
    weights = _weights(variant.config, seed)
    directory = write_checkpoint(str(tmp_path_factory.mktemp(variant.name)), variant.config, weights)
    ids = np.random.default_rng(100 + seed).integers(0, variant.config["vocab_size"], (BATCH, variant.length))
    ids = ids.astype(np.int32)
    reference = SpecReference(variant.config, weights).logits(ids, variant.placement)
    return VariantCase(variant, directory, weights, ids, reference)


@pytest.fixture(scope="module")
def variant_run(variant_case) -> VariantRun:
    """Our float32 logits for the variant: full forward, and prefill of the prompt then one-token decode steps."""
    variant, ids = variant_case.variant, variant_case.ids
    runner = ModelRunner(load_model(variant_case.directory, "float32"))
    placement = resolve_placement(runner.config, variant.placement)
    forward = np.asarray(runner.forward(ids, placement), np.float64)
    cache = runner.init_cache(BATCH, variant.length, placement)
    logits, cache = runner.extend(ids[:, : variant.prompt], 0, cache, placement)
    pieces = [np.asarray(logits, np.float64)]
    for t in range(variant.prompt, variant.length):
        logits, cache = runner.extend(ids[:, t : t + 1], t, cache, placement)
        pieces.append(np.asarray(logits, np.float64))
    return VariantRun(variant_case, forward, np.concatenate(pieces, axis=1))


def _check(case: VariantCase, ours: np.ndarray, label: str = "") -> None:
    assert ours.shape == case.reference.shape
    error = np.abs(ours - case.reference)
    t = int(np.unravel_index(error.argmax(), error.shape)[1])
    assert error.max() <= tolerance(case.reference), (
        f"{case.variant.name}{label}: max error {error.max():.3e} at position {t} (prompt {case.variant.prompt}), "
        f"logit scale {np.abs(case.reference).max():.2f}, tolerance {tolerance(case.reference):.2e}")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_reference_parameter_table_matches_the_loader(variant):
    """Sizes from defaults (dt_rank "auto", expand, absent d_xb/head_groups/kernel, d_state ignored) and bias
    flags give the same keys and shapes in the spec's table as in the model the loader builds."""
    _, _, expected = expected_parameters(parse_config(variant.config))
    assert {k: tuple(v.shape) for k, v in expected.items()} == parameter_shapes(variant.config)


def test_full_forward_matches_reference(variant_run):
    _check(variant_run.case, variant_run.forward)


def test_prefill_then_decode_matches_reference(variant_run):
    """Prefill positions and every decoded position (prompt .. length-1) against the reference's full sequence."""
    _check(variant_run.case, variant_run.cached)


def test_variant_features_move_the_logits_beyond_tolerance(variant_case):
    """Each feature a variant exercises changes the reference logits by at least 10x the tolerance, so a model
    that ignored it (or used the other value) would fail the comparisons above."""
    variant = variant_case.variant
    assert variant.mutations
    too_small = {}
    for description, mutate in variant.mutations.items():
        config = copy.deepcopy(variant.config)
        mutate(config)
        mutated = SpecReference(config, variant_case.weights, check_shapes=False)
        effect = float(np.abs(mutated.logits(variant_case.ids, variant.placement) - variant_case.reference).max())
        if effect < 10 * tolerance(variant_case.reference):
            too_small[description] = effect
    assert not too_small, f"{variant.name}: features whose effect is within 10x the tolerance: {too_small}"


# ----------------------------------------------------------------------------------------------------------------
# (c) Tensor parallelism: the split model against the reference
#
# ``load_model(..., tensor_parallel=tp)`` on the virtual CPU devices of tests/conftest.py. At TP=3 no variant
# divides evenly: the vocabulary (64), most head, group and MLP-channel counts are padded with zero rows, and heads
# fewer than the devices (2-head attention, KDA's 1 and 2 heads, 2-head Mamba, single GQA groups) are shared. TP=2
# pads the 5-head MHA and the 3-head GDN and shares single groups. Every variant can be split at 3 (the loader
# raises ShardingError only for fewer devices or vocabulary rows than tp), which loading it here shows.
#
# Tolerance: the same RTOL as one device. Splitting the contractions reorders float32 additions; measured
# 2026-11-30 on the CPU, max abs error of the split forward against the reference (TP=2 / TP=3), on logit scales of
# 3.3-4.9: norms_mlps_attention 1.8e-6 / 2.3e-6, attention_windows 2.0e-6 / 2.9e-6, gdn_heads_kernels 1.0e-5 /
# 1.4e-5, kda_kernels_sigmoid 2.9e-5 / 2.5e-5, mamba_biases_defaults 1.9e-5 / 1.7e-5, long_hybrid_over_chunks
# 3.3e-5 / 3.3e-5 (compiled with XLA's backend optimisation off; the default build, which the test runs, gave 2.0e-6
# to 2.9e-5): the same order as one device, the worst 8.4e-6 of scale (12x inside the tolerance).

TP_SIZES = (2, 3)


def _uneven_splits(config: dict, tp: int) -> list[str]:
    """The tensors whose rows at ``tp`` devices include zero padding or a head held by several devices."""
    plan = plan_tensor_parallel(parse_config(config), tp)
    uneven = []
    for key, shard in plan.tensors.items():
        units = [u for segment in shard.segments if segment.split is not None for row in segment.split.heads
                 for u in row]
        if -1 in units or len([u for u in units if u >= 0]) > len(set(units) - {-1}):
            uneven.append(key)
    return uneven


@pytest.mark.parametrize("tp", TP_SIZES)
def test_split_forward_matches_reference(variant_case, tp):
    """The full forward of the model split over ``tp`` devices against the reference logits."""
    variant = variant_case.variant
    if tp == 3:  # the risky case the variants are meant to exercise: padded or shared heads in every variant
        assert _uneven_splits(variant.config, tp), f"{variant.name}: every tensor splits evenly at tp={tp}"
    model = load_model(variant_case.directory, "float32", tensor_parallel=tp)
    assert isinstance(model, ShardedModel) and model.mesh.shape == {AXIS: tp}
    placement = resolve_placement(model.config, variant.placement)
    _check(variant_case, np.asarray(model.forward(variant_case.ids, placement), np.float64), f" tp={tp}")


_ENGINE_VARIANT = next(v for v in VARIANTS if v.name == "long_hybrid_over_chunks")
_ENGINE_TOKENS = 4


@pytest.mark.parametrize("variant_case", [_ENGINE_VARIANT], ids=lambda v: v.name, indirect=True)
def test_split_engine_greedy_follows_reference(variant_case):
    """The engine at TP=2 (paged KV caches and recurrent states split by heads, chunked prefill, decode steps) on
    every mixer type, a window shorter than the prompt and a supernet placement: its greedy tokens from each prompt
    are the reference's argmax continuation. Each argmax leads the runner-up by far more than the tolerance
    (measured: by 0.063 or more, on a tolerance of 4.7e-4), so a correct float32 model picks the same tokens.
    (Not on the variants with a conv kernel_size of 1, which the engine refuses at TP >= 2: XLA crashes compiling a
    split step that carries their empty conv state. Their split forward, which has no cache, is checked above.)"""
    variant = variant_case.variant
    reference = SpecReference(variant.config, variant_case.weights)
    sequences = variant_case.ids[:, : variant.prompt]
    for _ in range(_ENGINE_TOKENS):
        last = reference.logits(sequences, variant.placement)[:, -1]
        ranked = np.sort(last, axis=-1)
        assert (ranked[:, -1] - ranked[:, -2]).min() > tolerance(variant_case.reference), "an argmax near-tie"
        sequences = np.concatenate([sequences, last.argmax(-1)[:, None].astype(np.int32)], axis=1)
    want = sequences[:, variant.prompt :].tolist()

    llm = LLM(variant_case.directory, dtype="float32", tensor_parallel=2, placement=variant.placement,
              buckets=Buckets((2,), (2,), (8,)), max_num_seqs=2, max_model_len=variant.prompt + _ENGINE_TOKENS,
              max_num_batched_tokens=16, max_chunk=8, max_prefill_rows=2, page_size=4, cache_bytes=4 * 2**20,
              warm_up=False, log=lambda msg: None)
    prompts = [[int(t) for t in row] for row in variant_case.ids[:, : variant.prompt]]
    outputs = llm.generate(prompts, SamplingParams.greedy(max_new_tokens=_ENGINE_TOKENS, ignore_eos=True))
    assert [list(o.token_ids) for o in outputs] == want, f"{variant.name} tp=2: engine greedy tokens"
