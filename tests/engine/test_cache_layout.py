"""Cache families at natural sizes: regressions for the vLLM hybrid-cache bugs in ../shared/seeds."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from apriel2_jax.config import load_config
from apriel2_jax.engine.cache_layout import CacheConfigError, cache_layout, plan_cache
from apriel2_jax.engine.cache_manager import MIN_FITTED_TABLE_TOKENS, CacheManager, fitted_table_width
from apriel2_jax.modules import Apriel2ForCausalLM
from apriel2_jax.placement import load_placements, resolve_placement
from tests.conftest import REPO

SHAPED_05B = os.path.join(REPO, "..", "shared", "configs", "apriel2-0.5b-shaped")


@pytest.fixture(scope="module")
def config_05b():
    return load_config(SHAPED_05B)


def _placement(config, name):
    return resolve_placement(config, name, load_placements(SHAPED_05B))


def test_a12_g1_k11_builds_exactly_two_families_at_natural_sizes(config_05b):
    placement = _placement(config_05b, "a12-g1-k11")
    assert sum(p == "gdn" for p in placement) == 1 and sum(p == "kda" for p in placement) == 11
    layout = cache_layout(config_05b, placement, dtype_bytes=2)
    assert layout.families == ("full", "state")
    (full,) = layout.attention
    assert len(full.layers) == 12 and len(layout.state.layers) == 12
    # Attention: 2 KV heads x 64 x (K and V) x bf16 = 512 B per token per layer (spec §5.1).
    assert full.token_bytes == 12 * 512
    # Recurrent states at their own sizes: conv in bf16, recurrent state fp32; no page padding anywhere.
    gdn = 3 * (2 * 2 * 64 + 14 * 64) * 2 + 14 * 64 * 64 * 4
    kda = 3 * 3 * 14 * 64 * 2 + 14 * 64 * 64 * 4
    assert kda == 245_504
    assert layout.state.slot_bytes == gdn + 11 * kda


def test_attention_page_size_does_not_depend_on_state_size(config_05b):
    """vLLM inflated attention pages to the size of a recurrent state; here a page is page_size tokens."""
    budget = 2 * 2**30
    plans = {}
    for name in ("all-attention", "a12-g1-k11", "every2-kda"):
        layout = cache_layout(config_05b, _placement(config_05b, name), 2)
        plans[name] = (layout, plan_cache(layout, budget_bytes=budget, page_size=16, max_num_seqs=8,
                                          max_model_len=4096, max_chunk=512))
    for layout, plan in plans.values():
        (full,) = layout.attention
        assert plan.bytes["full"] == plan.pages["full"] * 16 * full.token_bytes
    # Same attention layer count (12) -> identical page bytes, whatever the recurrent layers are.
    a, b = plans["a12-g1-k11"], plans["every2-kda"]
    assert a[0].attention[0].token_bytes == b[0].attention[0].token_bytes


def test_device_memory_equals_the_sum_of_natural_sizes(config_05b):
    placement = _placement(config_05b, "a12-g1-k11")
    layout = cache_layout(config_05b, placement, 2)
    plan = plan_cache(layout, budget_bytes=2**28, page_size=16, max_num_seqs=4, max_model_len=2048, max_chunk=256)
    model = nnx.eval_shape(lambda: Apriel2ForCausalLM(config_05b, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    shapes = jax.eval_shape(lambda: model.init_paged_cache(placement, plan.pages, plan.page_size, plan.slots))
    total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    assert total == sum(plan.bytes.values())
    assert total <= 2**28


def test_window_families_get_their_own_bounded_pools(config_05b):
    names = ["sliding_window"] * 12 + ["attention"] * 6 + ["gdn"] * 6
    layout = cache_layout(config_05b, resolve_placement(config_05b, names), 2)
    assert layout.families == ("window_4096", "full", "state")
    plan = plan_cache(layout, budget_bytes=2**30, page_size=16, max_num_seqs=4, max_model_len=65536, max_chunk=512)
    # A window request never holds more than (W - 1 + chunk) / page + 1 pages.
    assert plan.table_width["window_4096"] == math.ceil((4095 + 512) / 16) + 1
    assert plan.pages["window_4096"] == 4 * plan.table_width["window_4096"] + 1
    assert plan.table_width["full"] == 65536 // 16


def test_one_metadata_build_per_step_for_all_layers(config_05b):
    layout = cache_layout(config_05b, _placement(config_05b, "a12-g1-k11"), 2)
    plan = plan_cache(layout, budget_bytes=2**28, page_size=16, max_num_seqs=4, max_model_len=2048, max_chunk=256)
    manager = CacheManager(layout, plan)
    for i in range(3):
        assert manager.try_allocate(i, 0, 100)
    step = manager.build_step_tables([0, 1, 2, None], rows=8)
    assert manager.metadata_builds == 1
    assert set(step.tables) == {"full"} and step.tables["full"].shape == (8, 2048 // 16)
    assert (step.slots[3:] == 0).all() and len(set(step.slots[:3])) == 3 and (step.slots[:3] > 0).all()
    assert (step.tables["full"][3:] == 0).all()
    manager.check_invariants()


@pytest.mark.parametrize("pages, full, page_size, want", [
    (0, 4096, 16, 1024 // 16),  # at least MIN_FITTED_TABLE_TOKENS
    (64, 4096, 16, 64),
    (65, 4096, 16, 96),  # the next half-octave width: 1.5 x 64
    (73, 4096, 16, 96),
    (96, 4096, 16, 96),
    (97, 4096, 16, 128),  # then a power of two
    (129, 4096, 16, 192),
    (3000, 4096, 16, 3072),
    (3073, 4096, 16, 4096),
    (3000, 3500, 16, 3072),
    (3100, 3500, 16, 3500),  # never past the family's full width
    (10, 30, 4, 30),
    (17, 100, 64, 24),  # 1.5 x 16 (16 pages of 64 are the 1024 tokens)
    (1, 8, 2048, 1),
    (2, 8, 2048, 2),
    (3, 8, 2048, 3),  # 1.5 x 2 is 3
])
def test_fitted_table_width(pages, full, page_size, want):
    assert MIN_FITTED_TABLE_TOKENS == 1024
    assert fitted_table_width(pages, full, page_size) == want


def test_decode_tables_fit_the_widest_row_and_keep_every_page(config_05b):
    layout = cache_layout(config_05b, _placement(config_05b, "a12-g1-k11"), 2)
    plan = plan_cache(layout, budget_bytes=2**30, page_size=16, max_num_seqs=4, max_model_len=65536, max_chunk=256)
    manager = CacheManager(layout, plan)
    for i, tokens in enumerate((100, 2000, 1500)):
        assert manager.try_allocate(i, 0, tokens)
    full = manager.build_step_tables([0, 1, 2, None], rows=4)
    fitted = manager.build_step_tables([0, 1, 2, None], rows=4, fit=True)
    assert full.tables["full"].shape == (4, 65536 // 16)
    assert fitted.tables["full"].shape == (4, 128)  # 2000 tokens: 125 pages
    np.testing.assert_array_equal(fitted.tables["full"], full.tables["full"][:, :128])
    assert not full.tables["full"][:, 128:].any()
    np.testing.assert_array_equal(fitted.slots, full.slots)
    assert manager.build_step_tables([0, None], rows=2, fit=True).tables["full"].shape == (2, 64)
    assert manager.build_step_tables([], rows=2, fit=True).tables["full"].shape == (2, 64)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(budget_bytes=2**20, max_num_seqs=64), "lower max_num_seqs or raise the memory budget"),
        (dict(budget_bytes=2**26, max_model_len=10**6), "lower max_model_len"),
    ],
)
def test_budgets_that_cannot_fit_fail_with_advice(config_05b, kwargs, message):
    layout = cache_layout(config_05b, _placement(config_05b, "a12-g1-k11"), 2)
    args = dict(page_size=16, max_num_seqs=4, max_model_len=2048, max_chunk=256)
    args.update(kwargs)
    with pytest.raises(CacheConfigError, match=message):
        plan_cache(layout, **args)


def test_window_pages_are_released_as_the_window_slides():
    from apriel2_jax.engine.cache_layout import AttentionFamily, CacheLayout, CachePlan

    layout = CacheLayout((AttentionFamily("window_8", 8, (0,), 4),), None)
    plan = CachePlan(4, {"window_8": 20}, {"window_8": 5}, 0, {"window_8": 0})
    manager = CacheManager(layout, plan)
    assert manager.try_allocate("r", 0, 16)  # positions 0..15: pages 0..3
    assert manager.blocks("r").tables["window_8"].__len__() == 4
    assert manager.try_allocate("r", 16, 1)  # queries at 16 see 9..16: pages 2..4 remain
    blocks = manager.blocks("r")
    assert blocks.first_page["window_8"] == 2 and len(blocks.tables["window_8"]) == 3
    assert manager.pools["window_8"].num_in_use == 3
    manager.check_invariants()
    manager.free("r")
    assert manager.pools["window_8"].num_in_use == 0
    manager.check_invariants()
