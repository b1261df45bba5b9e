"""Pallas paged decode attention (Triton backend): interpret mode against the jnp reference at small shapes, and
cross-lowering for CUDA at the production shape. Kept small: the interpreter costs ~1 s per compiled config."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops.paged_attention import paged_attention as reference
from pallas_kernels.paged_attention_decode import (merge_splits, merge_splits_xla, paged_attention,
                                                   paged_attention_decode, unsupported_reason)

PAGES = 24
WIDTH = 6


def _inputs(seed, heads, groups, page_size, head_dim=16, dtype=jnp.float32):
    """Four rows: 0 and 1 share their first two pages (out of order in the pool) and have contexts that are not a
    multiple of the page size; row 2 starts at logical page 2 (a window family that dropped two pages) with an
    empty entry inside its table; row 3 is all padding (table of sink pages)."""
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    perm = rng.permutation(np.arange(1, PAGES))
    table = np.zeros((4, WIDTH), np.int32)
    table[0, :4] = perm[[0, 1, 2, 3]]
    table[1, :6] = perm[[0, 1, 4, 5, 6, 7]]
    table[2, :4] = perm[[8, 9, 10, 11]]
    table[2, 1] = 0  # an empty entry: its keys are masked
    first_page = np.array([0, 0, 2, 0], np.int32)
    ps = page_size
    positions = np.array([3 * ps + ps // 2 - 1, 5 * ps + 2, (2 + 3) * ps + ps - 3, 0], np.int32)
    return dict(
        q=f(4, 1, heads, head_dim),
        k_pages=f(PAGES, page_size, groups, head_dim),
        v_pages=f(PAGES, page_size, groups, head_dim),
        block_table=jnp.asarray(table),
        first_page=jnp.asarray(first_page),
        q_positions=jnp.asarray(positions[:, None]),
    )


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _check(x, window, tol, **kw):
    out = paged_attention_decode(**x, window=window, interpret=True, **kw)
    assert out.shape == x["q"].shape and out.dtype == x["q"].dtype
    ref = reference(**x, window=window)
    assert _rel(out[:3], ref[:3]) <= tol
    # The all-padding row sees no key: finite zeros (the reference averages the sink page there).
    np.testing.assert_array_equal(np.asarray(out[3], np.float32), 0.0)
    return out


@pytest.mark.parametrize(
    "heads, groups, page_size, window, kw",
    [
        (2, 2, 16, None, {}),  # MHA (rep 1), auto splits
        (8, 2, 8, 20, dict(splits=2, prefetch_ids=2)),  # rep 4, window shorter than the context, 8 pages/block
        (7, 1, 16, 1000, dict(splits=3, block_tokens=32, prefetch_ids=0)),  # rep 7 (16 rows), window > context
    ],
)
def test_matches_reference_fp32(heads, groups, page_size, window, kw):
    _check(_inputs(0, heads, groups, page_size), window, 1e-5, **kw)


@pytest.mark.parametrize("page_size, window, block_tokens, page_ids, prefetch_ids",
                         [(8, 21, 32, "scalar", 2), (32, 37, 16, "scalar", 0), (8, 21, 32, "vector", 1)])
def test_page_id_loads_match_the_reference(page_size, window, block_tokens, page_ids, prefetch_ids):
    """Both ways of loading a block's page ids: one scalar per page (blocks aligned to the page grid, the window's
    first keys masked: a window that starts mid-page, four pages per block, or blocks inside a page) and one
    gathered id per key."""
    _check(_inputs(3, 8, 2, page_size), window, 1e-5, splits=2, block_tokens=block_tokens, page_ids=page_ids,
           prefetch_ids=prefetch_ids)


def test_two_rows_take_the_merge_kernel_and_match_the_reference():
    """At one or two rows the splits are merged by ``merge_splits``: rows 2 (a first page past 0, an empty entry)
    and 3 (no visible key) of the four-row inputs, alone."""
    x = _inputs(2, 8, 2, 8)
    rows = {k: v[2:] for k, v in x.items()}
    out = paged_attention_decode(**rows, window=None, interpret=True, splits=3, block_tokens=16)
    assert _rel(out[:1], reference(**rows)[:1]) <= 1e-5
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)


def test_bf16_blocks_smaller_than_a_page():
    _check(_inputs(1, 8, 2, 32, dtype=jnp.bfloat16), 40, 1e-2, splits=2, block_tokens=16)


def test_stale_sink_and_out_of_window_pages_are_never_read():
    """NaN in the sink page and in a page that slid out of the window must not reach the output: masked loads."""
    x = _inputs(2, 8, 2, 16)
    clean = paged_attention_decode(**x, window=40, splits=2, interpret=True)
    stale = int(x["block_table"][0, 0])  # row 0's first page: outside a 40-token window at position 55
    poisoned = x["k_pages"].at[0].set(jnp.nan).at[stale].set(jnp.nan)
    out = paged_attention_decode(**dict(x, k_pages=poisoned, v_pages=x["v_pages"].at[0].set(jnp.nan)), window=40,
                                 splits=2, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))
    # Scalar page ids start a block on the page grid, before the window's first key: row 1 (position 82) sees
    # keys 43..82, and its block from key 32 covers keys 32..42 that slid out, in the page of table column 2.
    start_page = int(x["block_table"][1, 2])
    slid_out = poisoned.at[start_page, :11].set(jnp.nan)
    scalar = paged_attention_decode(**dict(x, k_pages=slid_out, v_pages=x["v_pages"].at[0].set(jnp.nan)),
                                    window=40, splits=2, page_ids="scalar", interpret=True)
    np.testing.assert_allclose(np.asarray(scalar), np.asarray(clean), rtol=1e-5, atol=1e-6)


def test_entry_falls_back_for_prefill_and_unsupported_shapes():
    x = _inputs(3, 4, 2, 16)
    prefill = dict(x, q=jnp.concatenate([x["q"], x["q"]], axis=1),
                   q_positions=jnp.concatenate([x["q_positions"] - 1, x["q_positions"]], axis=1))
    assert unsupported_reason(**prefill) is not None
    np.testing.assert_array_equal(np.asarray(paged_attention(**prefill)), np.asarray(reference(**prefill)))
    odd = _inputs(3, 4, 2, 16, head_dim=12)
    assert "head_dim" in unsupported_reason(**odd)
    np.testing.assert_array_equal(np.asarray(paged_attention(**odd, window=8)), np.asarray(reference(**odd, window=8)))


def test_bad_inputs_raise():
    x = _inputs(4, 4, 2, 16)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_decode(**dict(x, q=x["q"][:, :, :3]), interpret=True)
    with pytest.raises(ValueError, match="block_table"):
        paged_attention_decode(**dict(x, block_table=x["block_table"][:2]), interpret=True)
    with pytest.raises(ValueError, match="block_tokens"):
        paged_attention_decode(**x, block_tokens=24, interpret=True)
    with pytest.raises(ValueError, match="prefetch_ids"):
        paged_attention_decode(**x, prefetch_ids=3, interpret=True)
    with pytest.raises(ValueError, match="window"):
        paged_attention_decode(**x, window=0, interpret=True)
    with pytest.raises(ValueError, match="page_ids"):
        paged_attention_decode(**x, page_ids="gathered", interpret=True)


def _lowered_for_cuda(batch, heads, groups, dim, page_size, width, **kw):
    """The kernel at these bf16 shapes, lowered for an H100 from this CPU: its module text."""
    S = jax.ShapeDtypeStruct
    pages = batch * width + 1
    args = (
        S((batch, 1, heads, dim), jnp.bfloat16),
        S((pages, page_size, groups, dim), jnp.bfloat16),
        S((pages, page_size, groups, dim), jnp.bfloat16),
        S((batch, width), jnp.int32),
        S((batch,), jnp.int32),
        S((batch, 1), jnp.int32),
    )
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        return paged_attention_decode.trace(*args, **kw).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("page_size, window", [(64, None), (16, None), (64, 1024)])
def test_cross_lowers_for_cuda_at_production_shapes(page_size, window):
    """64 sequences at 4096 tokens, 32 query heads over 8 KV heads, D = 128, bf16."""
    for kw in ({}, dict(splits=1)):
        text = _lowered_for_cuda(64, 32, 8, 128, page_size, 4096 // page_size, window=window, **kw)
        assert "triton" in text.lower()


def test_cross_lowers_for_cuda_with_128_token_blocks():
    """The 0.5B geometry at 32 rows (14 query heads over 2 KV heads, D = 64): the default schedule's throughput
    regime, 128-token blocks."""
    assert "paged_attention_decode_ps16_n128_s4\"" in _lowered_for_cuda(32, 14, 2, 64, 16, 73)


def test_cross_lowers_for_cuda_with_scalar_page_ids_at_one_row():
    """The 0.5B geometry at one row: one-block splits of 32 tokens, scalar page ids; at two rows of 64."""
    assert "paged_attention_decode_ps16_n32_s36_scalar" in _lowered_for_cuda(1, 14, 2, 64, 16, 73)
    assert "paged_attention_decode_ps16_n64_s18_scalar" in _lowered_for_cuda(2, 14, 2, 64, 16, 73)


@pytest.mark.parametrize("page_size, window", [(16, 40), (64, 70), (8, None)])
def test_default_one_row_schedule_matches_the_reference(page_size, window):
    """One bf16 row at the default schedule (32-token blocks at one row; the windows start mid-page), each of
    the inputs' three real rows alone."""
    from pallas_kernels.paged_attention_decode import table_schedule

    x = _inputs(5, 8, 2, page_size, dtype=jnp.bfloat16)
    assert table_schedule(1, 2, WIDTH, page_size, window, 16, jnp.bfloat16)[0] == 32
    for row in range(3):
        one = {k: v if k in ("k_pages", "v_pages") else v[row : row + 1] for k, v in x.items()}
        out = paged_attention_decode(**one, window=window, interpret=True)
        assert _rel(out, reference(**one, window=window)) <= 1e-2


def test_bf16_128_token_blocks_at_head_dim_64():
    x = _inputs(2, 4, 2, 16, head_dim=64, dtype=jnp.bfloat16)
    _check(x, None, 1e-2, splits=1, block_tokens=128)


def test_default_schedule_regimes():
    """64-token blocks while the programs fit in one wave of SMs (at one or two rows in splits of one block, as
    many as the wave holds; at one row 32-token blocks where the wave holds one split each); past it, 16 KB
    blocks per KV head (128 tokens at D = 64, still 64 at D = 128) in splits of at least two blocks; fp32 keeps
    32-token blocks."""
    from pallas_kernels.paged_attention_decode import default_schedule, table_schedule

    bf16 = jnp.bfloat16
    assert default_schedule(1, 2, 1168, 64, bf16) == (32, 36)  # 72 programs: one row, one 32-token block each
    assert default_schedule(2, 2, 1168, 64, bf16) == (64, 18)  # 72 programs: one 64-token block per split
    assert default_schedule(1, 2, 8192, 64, bf16) == (64, 66)  # the wave's 132 programs bound the splits
    assert default_schedule(1, 2, 2112, 64, bf16) == (32, 66)  # 66 blocks of 32: still one per split
    assert default_schedule(1, 2, 2144, 64, bf16) == (64, 33)  # 67 would not fit: 64-token blocks
    # a 1024-token window starting mid-page spans 17 blocks of 64 on the page grid (33 of 32): one split each
    assert table_schedule(2, 2, 80, 16, 1024, 64, bf16) == (64, 17)
    assert table_schedule(1, 2, 80, 16, 1024, 64, bf16) == (32, 33)
    assert table_schedule(1, 2, 17, 64, 1000, 64, bf16) == (32, 33)  # 64-token pages: up to 31 tokens before
    assert default_schedule(1, 8, 512, 128, bf16) == (32, 16)  # 8 KV heads: 16 splits fill the wave
    assert default_schedule(1, 2, 16, 64, bf16) == (32, 1)
    assert default_schedule(1, 2, 1168, 64, jnp.float32) == (32, 9)  # fp32 keeps its own schedule at one row
    assert table_schedule(1, 2, 73, 16, None, 64, bf16) == default_schedule(1, 2, 73 * 16, 64, bf16)
    assert default_schedule(4, 2, 1168, 64, bf16) == (64, 9)  # 72: splits of at least two blocks from 3 rows
    assert default_schedule(8, 2, 1168, 64, bf16) == (128, 4)  # 144 at 64-token blocks: past one wave
    assert default_schedule(32, 2, 1168, 64, bf16) == (128, 4)
    assert default_schedule(32, 2, 1536, 64, bf16) == (128, 6)
    assert default_schedule(8, 8, 32768, 128, bf16) == (64, 16)  # D = 128: the same blocks either way
    assert default_schedule(1, 8, 1024, 128, bf16) == (64, 16)
    assert default_schedule(8, 2, 1168, 64, jnp.float32) == (32, 9)


def test_choose_splits_fills_the_gpu_only_with_long_enough_splits():
    from pallas_kernels.paged_attention_decode import choose_splits

    assert choose_splits(1, 2, 1104, 64) == 8  # small batch, short context: splits of >= 128 tokens
    assert choose_splits(8, 8, 32768, 64) == 16  # enough programs (1024) long before the split length binds
    assert choose_splits(256, 8, 32768, 64) == 1
    assert choose_splits(1, 1, 100, 64) == 1
    assert choose_splits(32, 2, 1168, 128) == 4  # 128-token blocks: splits of >= two blocks


# ------------------------------------------------------------------ RoPE + page write + attention in one kernel


def _new_token_inputs(seed, heads, groups, page_size, dtype=jnp.float32):
    """The four rows of ``_inputs`` as a decode step before RoPE: new keys and values, cos/sin of the positions,
    each row's slot (row 3 is padding: the sink slot)."""
    from apriel2_jax.ops.paged_attention import page_slots
    from apriel2_jax.ops.rope import rope_cos_sin

    x = _inputs(seed, heads, groups, page_size, dtype=dtype)
    rng = np.random.default_rng(seed + 100)
    head_dim = x["q"].shape[-1]
    positions = x["q_positions"]
    token_mask = jnp.asarray([[True], [True], [True], [False]])
    slots = page_slots(positions, token_mask, x["block_table"], x["first_page"], page_size)[:, 0]
    cos, sin = rope_cos_sin(positions[:, 0], head_dim, 10000.0, dtype)
    new = lambda: jnp.asarray(rng.standard_normal((4, groups, head_dim)), dtype)  # noqa: E731
    return dict(q=x["q"][:, 0], k=new(), v=new(), cos=cos, sin=sin, slots=slots, k_pages=x["k_pages"],
                v_pages=x["v_pages"], block_table=x["block_table"], first_page=x["first_page"], q_positions=positions)


@pytest.mark.parametrize(
    "dtype, heads, groups, page_size, window, packed, kw, tol",
    [
        (jnp.float32, 8, 2, 8, None, False, dict(splits=3), 1e-5),  # the new key in split 0, the rest in 3 splits
        # one split writes the output; scalar page ids with a window starting mid-page
        (jnp.float32, 7, 1, 16, 20, True, dict(splits=1, block_tokens=16, page_ids="scalar"), 1e-5),
        (jnp.bfloat16, 8, 2, 16, None, False, dict(splits=2, block_tokens=16), 2e-2),
    ],
)
def test_rope_write_attention_matches_the_chain_and_writes_only_its_slots(dtype, heads, groups, page_size, window,
                                                                         packed, kw, tol):
    from apriel2_jax.ops.paged_attention import rope_write_paged_attention as chain
    from pallas_kernels.paged_attention_decode import rope_write_paged_attention_decode

    x = _new_token_inputs(5, heads, groups, page_size, dtype)
    ref, k_ref, v_ref = chain(**x, window=window)
    if packed:  # the query heads, keys and values in one buffer
        x = dict(x, q=jnp.concatenate([x["q"], x["k"], x["v"]], axis=1), k=None, v=None)
        packed_ref = chain(**x, window=window)
        for a, b in zip(packed_ref, (ref, k_ref, v_ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out, k_pages, v_pages = rope_write_paged_attention_decode(**x, window=window, interpret=True, **kw)
    assert out.shape == ref.shape and out.dtype == dtype and k_pages.shape == x["k_pages"].shape
    assert _rel(out[:3], ref[:3]) <= tol
    np.testing.assert_array_equal(np.asarray(out[3], np.float32), 0.0)  # padding: no visible key, zero output
    flat = lambda a: np.asarray(a, np.float32).reshape(-1, a.shape[2] * a.shape[3])  # noqa: E731
    written = np.zeros(flat(k_ref).shape[0], bool)
    written[np.asarray(x["slots"])[:3]] = True  # row 3 is padding: its sink slot is left as it was
    for got, want, before in ((k_pages, k_ref, x["k_pages"]), (v_pages, v_ref, x["v_pages"])):
        # The rows' slots hold the rotated keys and the values (to the dtype's last bit: RoPE's rounding order);
        # every other slot, the padding row's sink slot included, is untouched (in the chain too).
        np.testing.assert_allclose(flat(got)[written], flat(want)[written], rtol=tol, atol=tol)
        np.testing.assert_array_equal(flat(got)[~written], flat(before)[~written])
        np.testing.assert_array_equal(flat(want)[~written], flat(before)[~written])
        assert not np.array_equal(flat(got)[written][:3], flat(before)[written][:3])


def test_rope_write_attention_entry_falls_back_and_rejects_bad_inputs():
    from apriel2_jax.ops.paged_attention import rope_write_paged_attention as chain
    from pallas_kernels.paged_attention_decode import rope_write_paged_attention, rope_write_paged_attention_decode

    odd = _new_token_inputs(6, 4, 2, 16)
    odd = dict(odd, q=odd["q"][..., :12], k=odd["k"][..., :12], v=odd["v"][..., :12], cos=odd["cos"][:, :12],
               sin=odd["sin"][:, :12], k_pages=odd["k_pages"][..., :12], v_pages=odd["v_pages"][..., :12])
    for got, want in zip(rope_write_paged_attention(**odd), chain(**odd)):  # head_dim 12: the chain runs
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    x = _new_token_inputs(6, 4, 2, 16)
    with pytest.raises(ValueError, match="slots"):
        rope_write_paged_attention_decode(**dict(x, slots=x["slots"][:2]), interpret=True)
    with pytest.raises(ValueError, match="cos"):
        rope_write_paged_attention_decode(**dict(x, cos=x["cos"].astype(jnp.bfloat16)), interpret=True)
    with pytest.raises(ValueError, match="H \\+ 2G"):  # packed, but no room for query heads
        rope_write_paged_attention_decode(**dict(x, q=x["q"][:, :4], k=None, v=None), interpret=True)


def test_rope_write_attention_cross_lowers_for_cuda():
    """The 0.5B geometry's attention (14 query heads over 2 KV heads, D = 64), 32 rows, bf16."""
    from pallas_kernels.paged_attention_decode import rope_write_paged_attention_decode

    S = jax.ShapeDtypeStruct
    batch, heads, groups, dim, page_size, width = 32, 14, 2, 64, 16, 69
    pages = batch * width + 1
    bf = jnp.bfloat16
    args = (S((batch, heads, dim), bf), S((batch, groups, dim), bf), S((batch, groups, dim), bf), S((batch, dim), bf),
            S((batch, dim), bf), S((batch,), jnp.int32), S((pages, page_size, groups, dim), bf),
            S((pages, page_size, groups, dim), bf), S((batch, width), jnp.int32), S((batch,), jnp.int32),
            S((batch, 1), jnp.int32))
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        lowered = rope_write_paged_attention_decode.trace(*args).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text().lower()
        packed = (S((batch, heads + 2 * groups, dim), bf), None, None) + args[3:]  # Q/K/V heads in one buffer
        lowered = rope_write_paged_attention_decode.trace(*packed).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text().lower()


def _merge_inputs():
    """Split partials for the merges: 9 splits (not a power of two), empty splits (m = -1e30, l = 0) in a row, a
    row whose splits are all empty, and spare head rows past the merged heads (the interpreter's layout). Returns
    (acc, m, l, heads, the flash-decoding merge of the first ``heads`` heads in jnp)."""
    rng = np.random.default_rng(0)
    batch, splits, heads, spare, dim = 3, 9, 5, 3, 16
    acc = jnp.asarray(rng.standard_normal((batch, splits, heads + spare, dim)), jnp.float32)
    m = jnp.asarray(rng.standard_normal((batch, splits, heads + spare)) * 4, jnp.float32)
    l = jnp.asarray(rng.uniform(0.5, 3, (batch, splits, heads + spare)), jnp.float32)
    empty = np.zeros((batch, splits, heads + spare), bool)
    empty[1, 3:] = True
    empty[2] = True
    m = jnp.where(empty, -1e30, m)
    l = jnp.where(empty, 0.0, l)
    acc = jnp.where(empty[..., None], 0.0, acc)
    a, mm, ll = acc[:, :, :heads], m[:, :, :heads], l[:, :, :heads]
    w = jnp.exp2(mm - jnp.max(mm, axis=1, keepdims=True))
    l_sum = jnp.sum(w * ll, axis=1)
    want = jnp.sum(w[..., None] * a, axis=1) / jnp.where(l_sum > 0, l_sum, 1.0)[..., None]
    return acc, m, l, heads, want


def test_merge_kernel_matches_the_flash_decoding_merge():
    """The split merge (one kernel) against its formula in jnp; the spare head rows must not be read, and a row
    with no visible key gets zeros, not NaN."""
    acc, m, l, heads, want = _merge_inputs()
    got = merge_splits(acc, m, l, heads=heads, dtype=jnp.float32, interpret=True)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    assert not np.any(np.asarray(got[2]))  # no visible key: zeros


@pytest.mark.parametrize("unrolled_max_splits", [16, 4])  # 9 splits: one split after another, then reductions
def test_xla_merge_matches_the_flash_decoding_merge(unrolled_max_splits, monkeypatch):
    """The merge above the merge kernel's rows (XLA) against the same formula, in both of its forms."""
    import pallas_kernels.paged_attention_decode as module

    monkeypatch.setattr(module, "UNROLLED_MERGE_MAX_SPLITS", unrolled_max_splits)
    acc, m, l, heads, want = _merge_inputs()
    got = merge_splits_xla(acc[:, :, :heads], m[:, :, :heads], l[:, :, :heads], dtype=jnp.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    assert not np.any(np.asarray(got[2]))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the kernel compiled for the GPU itself")
@pytest.mark.parametrize("batch, splits", [(1, 36), (2, 18), (32, 4)])
def test_merge_kernel_on_the_gpu_at_the_05b_shapes(batch, splits):
    """The merge as the 0.5B decode runs it (14 query heads of 64, bf16 output) against its formula in jnp:
    equal but where an fp32 sum in another order lands on the other side of a bf16 step."""
    rng = np.random.default_rng(batch)
    heads, dim = 14, 64
    acc = jnp.asarray(rng.standard_normal((batch, splits, heads, dim)), jnp.float32)
    m = jnp.asarray(rng.standard_normal((batch, splits, heads)) * 4, jnp.float32)
    l = jnp.asarray(rng.uniform(0.5, 3, (batch, splits, heads)), jnp.float32)
    got = jax.jit(lambda a, b, c: merge_splits(a, b, c, heads=heads, dtype=jnp.bfloat16))(acc, m, l)
    w = jnp.exp2(m - jnp.max(m, axis=1, keepdims=True))
    want = (jnp.sum(w[..., None] * acc, axis=1) / jnp.sum(w * l, axis=1)[..., None]).astype(jnp.bfloat16)
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    assert diff.max() <= 2 ** -7 * float(np.abs(np.asarray(want, np.float32)).max())
    assert (diff > 0).mean() < 0.01


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the kernel compiled for the GPU itself")
@pytest.mark.parametrize("rows, page_ids", [(1, None), (1, "vector"), (2, None), (32, None), (32, "scalar")])
def test_rope_write_attention_on_the_gpu_at_the_05b_shapes(rows, page_ids):
    """The fused decode attention as the 0.5B engine runs it (14/2 heads of 64, bf16, 16-token pages, 73-page
    tables in random page order, context 1024; the default schedule: scalar page ids and one-block splits at one
    (32 tokens) and two rows (64), vector ids at 32) and with the other page-id loads, against the jnp chain."""
    from apriel2_jax.benchmarking import paged_decode_inputs
    from apriel2_jax.ops.paged_attention import rope_write_paged_attention as chain
    from pallas_kernels.paged_attention_decode import rope_write_paged_attention_decode

    x, qkv, [(k_pages, v_pages)] = paged_decode_inputs(rows, 14, 2, 64, 1024, 16, 73, seed=rows)
    args = (qkv, None, None, x["cos"], x["sin"], x["slots"], k_pages, v_pages, x["table"], x["first"],
            x["positions"])
    want, k_want, _ = jax.jit(chain)(*args)
    got, k_got, _ = jax.jit(functools.partial(rope_write_paged_attention_decode, page_ids=page_ids))(*args)
    assert _rel(got, want) <= 2e-2
    np.testing.assert_allclose(np.asarray(k_got[1:], np.float32), np.asarray(k_want[1:], np.float32), rtol=2e-2,
                               atol=2e-2)  # the sink page 0 is the chain's to write, never the kernel's
