"""The modules' fused decode path (``ops.decode_fused`` chains, taken where ``dispatch.kernel`` finds a kernel): with
the jnp chains registered as this backend's kernels, the engine runs that path on CPU and must still reproduce
every golden case's greedy tokens, for every placement."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from apriel2_jax import dispatch
from apriel2_jax.config import MLPConfig
from apriel2_jax.engine.llm import LLM
from apriel2_jax.engine.sampling import SamplingParams
from apriel2_jax.engine.step import Buckets
from apriel2_jax.modules.attention import Attention
from apriel2_jax.modules.gdn import GatedDeltaNet
from apriel2_jax.modules.kda import KimiDeltaAttention
from apriel2_jax.modules.layers import RMSNorm
from apriel2_jax.modules.mixers import active
from apriel2_jax.modules.mlp import MLP
from apriel2_jax.ops import decode_fused
from apriel2_jax.placement import resolve_placement
from tests.conftest import golden_cases
from tests.helpers import golden_model

FUSED = ("norm_projections", "norm_projections_conv", "norm_gated_mlp", "matmul_add")


class Calls(dict):
    """Traced calls per chain, and the number of projections of each ``norm_projections(_conv)`` call."""

    def __init__(self, *args):
        super().__init__(*args)
        self.projections: list[int] = []


def _chains_as_kernels(monkeypatch, names) -> Calls:
    """Register the jnp chains ``names`` as CPU kernels for the test; count the calls that trace them."""
    calls = Calls.fromkeys(names, 0)

    def counted(name):
        def fn(*args, **kwargs):
            calls[name] += 1
            if name.startswith("norm_projections"):
                calls.projections.append(len(args[3]))
            out = getattr(decode_fused, name)(*args, **kwargs)
            if kwargs.get("pad_columns"):  # columns past the projections', as a kernel's tile padding: NaN here
                pad = lambda y: jnp.pad(y, ((0, 0), (0, 5)), constant_values=jnp.nan)  # noqa: E731
                out = pad(out) if name == "norm_projections" else (pad(out[0]), out[1])
            return out
        return fn

    kernels = dict(dispatch._KERNELS)
    kernels.update({(name, "cpu"): counted(name) for name in names})
    monkeypatch.setattr(dispatch, "_KERNELS", kernels)
    return calls


@pytest.fixture
def fused_chains_as_kernels(monkeypatch):
    return _chains_as_kernels(monkeypatch, FUSED)


def _assert_engine_greedy_matches(case_name, case, model):
    """The engine's greedy tokens (two rows, decode steps of two rows) equal the golden ones, every placement."""
    llm = LLM(model=model, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16, max_chunk=8,
              max_prefill_rows=2, page_size=4, cache_bytes=4 * 2**20, warm_up=False, log=lambda msg: None,
              buckets=Buckets((2,), (2,), (8,)), placements=case.placements)
    prompts = [[int(t) for t in case.input_ids[r, : case.prompt_len]] for r in (0, 1)]
    for name in case.placements:
        llm.set_placement(name)
        outputs = llm.generate(prompts, SamplingParams.greedy(max_new_tokens=8, ignore_eos=True))
        np.testing.assert_array_equal(np.array([o.token_ids for o in outputs]), case.greedy_ids[name],
                                      err_msg=f"{case_name}/{name}")


@pytest.mark.parametrize("case_name", golden_cases())
def test_engine_greedy_through_the_fused_decode_path_matches_goldens(case_name, fused_chains_as_kernels):
    case, model, _ = golden_model(case_name)
    _assert_engine_greedy_matches(case_name, case, model)
    # Every block's MLP took the fused chain (gated MLPs in every golden case); attention layers took theirs.
    assert fused_chains_as_kernels["norm_gated_mlp"] > 0
    assert fused_chains_as_kernels["matmul_add"] >= fused_chains_as_kernels["norm_gated_mlp"]
    # Attention layers without biases took the fused norm + Q/K/V chain (those with biases keep the unfused one),
    # GDN and KDA layers their fused norm + input projections (GDN's with its conv); Mamba layers never.
    # The chain's projection count names the mixer: Q/K/V 3, GDN's q|k|v|z and b|a 2, KDA's six.
    expected = {
        {Attention: 3, GatedDeltaNet: 2, KimiDeltaAttention: 6}[type(mixer)]
        for name in case.placements
        for block, mixer_name in zip(model.model.decoder.blocks, resolve_placement(model.config, name, case.placements))
        for mixer in [active(block.mixer, mixer_name)]
        if isinstance(mixer, (GatedDeltaNet, KimiDeltaAttention))
        or (isinstance(mixer, Attention) and mixer.q_proj.bias is None)
    }
    assert set(fused_chains_as_kernels.projections) == expected
    has_gdn = any(isinstance(active(block.mixer, mixer_name), GatedDeltaNet)
                  for name in case.placements
                  for block, mixer_name in zip(model.model.decoder.blocks,
                                               resolve_placement(model.config, name, case.placements)))
    assert (fused_chains_as_kernels["norm_projections_conv"] > 0) == has_gdn  # GDN's conv in its projections


@pytest.mark.parametrize("case_name", ["hybrid_all_mixers", "supernet_swa"])  # the cases with head_dim >= 16
def test_engine_greedy_through_the_rope_write_attention_kernel_matches_goldens(case_name, monkeypatch):
    """The Pallas kernel for RoPE + page write + attention (interpret mode, registered as this backend's kernel)
    in the engine's decode steps: every placement's greedy tokens of the golden cases whose attention it takes
    (full and sliding-window layers)."""
    from apriel2_jax.ops.paged_attention import rope_write_paged_attention as chain
    from pallas_kernels.paged_attention_decode import rope_write_paged_attention_decode, unsupported_reason

    calls = []

    def kernel(q, k, v, cos, sin, slots, k_pages, v_pages, table, first, positions, window):
        if unsupported_reason(q[:, None], k_pages, v_pages, table, first, positions) is not None:
            return chain(q, k, v, cos, sin, slots, k_pages, v_pages, table, first, positions, window)
        calls.append(q.shape)
        return rope_write_paged_attention_decode(q, k, v, cos, sin, slots, k_pages, v_pages, table, first, positions,
                                                 None if window is None else int(window), interpret=True)

    kernels = dict(dispatch._KERNELS)
    kernels[("rope_write_paged_attention", "cpu")] = kernel
    monkeypatch.setattr(dispatch, "_KERNELS", kernels)
    case, model, _ = golden_model(case_name)
    _assert_engine_greedy_matches(case_name, case, model)
    assert calls  # decode steps went through the kernel


def test_engine_greedy_through_the_gemv_kernels_matches_goldens(monkeypatch):
    """The decode GEMV kernels (interpret mode, registered as this backend's kernels for every row count they
    take) in the engine's decode steps of a golden case with attention, GDN, KDA and Mamba layers."""
    from pallas_kernels import decode_gemv

    calls = dict.fromkeys(FUSED, 0)

    def interpreted(name):
        def fn(*args, pad_columns=False):  # the GEMV kernels' outputs have no padding columns
            if getattr(decode_gemv, f"{name}_unsupported")(*args) is not None:
                return getattr(decode_fused, name)(*args)
            calls[name] += 1
            return getattr(decode_gemv, f"{name}_kernel")(*args, interpret=True)
        return fn

    kernels = dict(dispatch._KERNELS)
    kernels.update({(name, "cpu"): interpreted(name) for name in FUSED})
    monkeypatch.setattr(dispatch, "_KERNELS", kernels)
    case, model, _ = golden_model("hybrid_all_mixers")
    _assert_engine_greedy_matches("hybrid_all_mixers", case, model)
    assert all(calls.values()), calls


def test_engine_greedy_through_the_whole_mlp_op_matches_goldens(monkeypatch):
    """With ``gated_mlp_residual`` registered (the jnp chain as this backend's kernel) beside the two-kernel chain,
    decode MLPs take the whole-MLP op (with the block's norm, gate, up and down weights: the greedy tokens are
    unchanged) and never the two-kernel chain."""
    calls = _chains_as_kernels(monkeypatch, ("gated_mlp_residual", "norm_gated_mlp"))
    case, model, _ = golden_model("hybrid_all_mixers")
    _assert_engine_greedy_matches("hybrid_all_mixers", case, model)
    assert calls["gated_mlp_residual"] > 0 and calls["norm_gated_mlp"] == 0, calls


def test_tensor_parallel_down_projection_keeps_the_psum_path(monkeypatch):
    """A down projection that sums over devices (``reduce_axis``) must not take the whole-MLP op, which has no
    psum: with the op registered and no two-kernel chain, the module declines the fused path."""
    calls = _chains_as_kernels(monkeypatch, ("gated_mlp_residual",))
    cfg = MLPConfig(intermediate_size=32, activation="silu", gated=True, up_bias=False, down_bias=False)
    mlp = MLP(cfg, 16, dtype=jnp.float32, rngs=nnx.Rngs(0))
    norm = RMSNorm(16, 1e-5, dtype=jnp.float32)
    x = jnp.ones((2, 1, 16), jnp.float32)
    assert mlp.decode_residual(x, norm) is not None  # the single-device module takes the op
    assert calls["gated_mlp_residual"] == 1
    mlp.down_proj.reduce_axis = "tp"
    assert mlp.decode_residual(x, norm) is None and calls["gated_mlp_residual"] == 1


def test_unregister_drops_a_kernel_for_the_unfused_baseline(monkeypatch):
    monkeypatch.setattr(dispatch, "_KERNELS", dict(dispatch._KERNELS))
    dispatch.register("rope_write_paged_attention", "cpu", decode_fused.matmul_add)  # any callable will do
    assert dispatch.kernel("rope_write_paged_attention").__wrapped__ is decode_fused.matmul_add  # lowered_once
    dispatch.unregister("rope_write_paged_attention")
    assert dispatch.kernel("rope_write_paged_attention") is None
    dispatch.unregister("rope_write_paged_attention")  # nothing registered: no error
