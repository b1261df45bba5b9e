"""Paged prefill attention kernel: interpret mode against the jnp reference on CPU (random page tables, cached
prefixes, padding, windows, GQA), and cross-lowering for CUDA at production shapes (catches the Triton backend's
power-of-two and dot-shape rules without a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops.paged_attention import paged_attention as reference
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention_prefill import (
    paged_attention,
    paged_attention_mosaic,
    paged_attention_prefill,
    paged_attention_prefill_mgpu,
)


def _inputs(seed, *, cached, new, length, heads, groups, dim=32, page_size=16, width=8, first_page=None,
            empty=(), share_prefix=False, dtype=jnp.float32, num_pages=40):
    """Rows as the engine builds them: row s has ``cached[s]`` tokens already in pages and ``new[s]`` valid new
    tokens (padded to ``length``) at consecutive positions; its table maps logical page first_page[s] + j to a
    random page id (out of order) for every page holding a token, 0 elsewhere and at the (row, column) pairs
    in ``empty``. The whole pool (the sink included) is random, so reading a masked slot would show."""
    rng = np.random.default_rng(seed)
    rows = len(cached)
    first_page = np.zeros(rows, np.int32) if first_page is None else np.asarray(first_page, np.int32)
    ids = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((rows, width), np.int32)
    used = 0
    for s in range(rows):
        end = cached[s] + new[s]
        assert (end - 1) // page_size - first_page[s] < width, "test setup: table too narrow"
        for j in range(width):
            if (first_page[s] + j) * page_size < end:
                table[s, j] = ids[used]
                used += 1
    if share_prefix:  # row 1 shares row 0's first two (full, cached) pages, as forked prompts do
        table[1, :2] = table[0, :2]
    for s, j in empty:
        table[s, j] = 0
    positions = np.stack([np.arange(c, c + length) for c in cached]).astype(np.int32)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    x = dict(
        q=f(rows, length, heads, dim),
        k_pages=f(num_pages, page_size, groups, dim),
        v_pages=f(num_pages, page_size, groups, dim),
        block_table=jnp.asarray(table),
        first_page=jnp.asarray(first_page),
        q_positions=jnp.asarray(positions),
    )
    valid = np.arange(length)[None, :] < np.asarray(new)[:, None]
    return x, valid


def _rel(out, ref, valid):
    out, ref = np.asarray(out, np.float32)[valid], np.asarray(ref, np.float32)[valid]
    return float(np.abs(out - ref).max() / np.abs(ref).max())


CASES = {
    # rep 1, one page per key block (contiguous slices), cached prefix not page-aligned, a padding-only row
    "rep1": dict(cached=[0, 37, 5], new=[40, 19, 0], length=48, heads=2, groups=2, width=8),
    # rep 4, two pages per key block (gathered rows), shared prefix pages, a short window, first_page > 0
    # (pages before it slid out), an empty entry inside the window
    "rep4_window": dict(cached=[60, 70], new=[33, 20], length=40, heads=8, groups=2, window=24,
                        first_page=[2, 3], share_prefix=False, empty=[(0, 0)], block_k=32),
    # rep 2, a window that leaves unmasked key blocks between its trailing edge and the causal diagonal; an
    # empty page inside it (one page per key block: the scalar empty-page bias)
    "rep2_mid_window": dict(cached=[100], new=[40], length=48, heads=4, groups=2, window=70, width=10,
                            first_page=[2], empty=[(0, 3)]),
    # rep 7, page size 32 > block_k, window longer than the context, rows sharing prefix pages
    "rep7_long_window": dict(cached=[64, 64], new=[30, 17], length=32, heads=7, groups=1, page_size=32,
                             width=4, window=1000, share_prefix=True, block_q=16),
    # the dispatch entry's configuration for head dim <= 64 on long chunks: 128-key blocks over 8 pages of 16
    "d64_dispatch_blocks": dict(cached=[0, 20], new=[128, 100], length=128, heads=4, groups=2, dim=64, width=8,
                                block_q=64, block_k=128),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference_fp32(case):
    kw = dict(CASES[case])
    window = kw.pop("window", None)
    blocks = {k: kw.pop(k) for k in ("block_q", "block_k") if k in kw}
    x, valid = _inputs(0, **kw)
    out = paged_attention_prefill(**x, window=window, interpret=True, **{"block_q": 32, "block_k": 16, **blocks})
    ref = reference(**x, window=window)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert np.isfinite(np.asarray(out)).all()  # padding tokens and padding rows included
    assert _rel(out, ref, valid) <= 1e-5


def test_kernel_bf16_operands():
    x, valid = _inputs(1, cached=[21, 0], new=[30, 45], length=64, heads=8, groups=2, dtype=jnp.bfloat16,
                       first_page=[1, 0], width=6)
    out = paged_attention_prefill(**x, window=40, block_q=32, block_k=32, interpret=True)
    ref = reference(**x, window=40)
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out, ref, valid) <= 1e-2


def test_dispatch_falls_back_for_single_tokens_and_unsupported_head_dims():
    x, _ = _inputs(2, cached=[5, 9], new=[1, 1], length=1, heads=4, groups=2)
    np.testing.assert_array_equal(np.asarray(paged_attention(**x)), np.asarray(reference(**x)))
    np.testing.assert_array_equal(np.asarray(paged_attention_mosaic(**x)), np.asarray(reference(**x)))
    x, _ = _inputs(3, cached=[5, 9], new=[4, 4], length=4, heads=4, groups=2, dim=24)
    np.testing.assert_array_equal(np.asarray(paged_attention(**x, window=8)), np.asarray(reference(**x, window=8)))


def test_bad_inputs_raise_clear_errors():
    x, _ = _inputs(4, cached=[0], new=[16], length=16, heads=3, groups=2)
    with pytest.raises(ValueError, match="must divide"):
        paged_attention_prefill(**x, interpret=True)
    x, _ = _inputs(4, cached=[0], new=[16], length=16, heads=4, groups=2)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention_prefill(**x, block_q=48, interpret=True)
    with pytest.raises(ValueError, match="q_positions"):
        paged_attention_prefill(**dict(x, q_positions=x["q_positions"][:, :8]), interpret=True)


H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)


def test_mgpu_kernel_interpretable_formulation_matches_reference():
    """GPU interpret mode (race detection on) at one tile of 2 x 64 rows: a window that makes warpgroup 1 skip the
    CTA's first key step and warpgroup 0 its last, an empty page inside the window, a padding-heavy row."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    x, valid = _inputs(5, cached=[190, 0], new=[90, 128], length=128, heads=4, groups=2, dim=64, page_size=64,
                       width=6, first_page=[1, 0], empty=[(0, 2)], dtype=jnp.bfloat16, num_pages=12)
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H100)
    with jax.sharding.use_abstract_mesh(mesh), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        out = paged_attention_prefill_mgpu(**x, window=70, interpretable=True)
    assert not interpret_pallas_call.get_races().races_found
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out, reference(**x, window=70), valid) <= 1e-2


@pytest.mark.parametrize("window", [None, 4096])
def test_mgpu_kernel_cross_lowers_for_cuda(window):
    """The production (register-operand P @ V) formulation at S=2, T=4096, 32/8 heads, D=128, page size 64."""
    S = jax.ShapeDtypeStruct
    args = (S((2, 4096, 32, 128), jnp.bfloat16), S((300, 64, 8, 128), jnp.bfloat16), S((300, 64, 8, 128), jnp.bfloat16),
            S((2, 130), jnp.int32), S((2,), jnp.int32), S((2, 4096), jnp.int32))
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H100)):
        lowered = paged_attention_prefill_mgpu.trace(*args, window=window).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text().lower()


@pytest.mark.parametrize("rows, length, window, heads, groups, dim, page_size", [
    (2, 4096, None, 32, 8, 128, 64),
    (8, 512, 4096, 32, 8, 128, 64),
    (8, 1024, None, 14, 2, 64, 16),  # the 0.5B geometry's prefill step: the entry's head-dim-64 configuration
])
def test_cross_lowers_for_cuda_at_production_shapes(rows, length, window, heads, groups, dim, page_size):
    """bf16 at production head counts, head dims and page sizes; default and a large block configuration."""
    S = jax.ShapeDtypeStruct
    width, pool = 256, 2048
    args = (
        S((rows, length, heads, dim), jnp.bfloat16),
        S((pool, page_size, groups, dim), jnp.bfloat16),
        S((pool, page_size, groups, dim), jnp.bfloat16),
        S((rows, width), jnp.int32),
        S((rows,), jnp.int32),
        S((rows, length), jnp.int32),
    )
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H100)):
        for blocks in (dict(), dict(block_q=128, block_k=128, num_warps=8)):
            lowered = paged_attention_prefill.trace(*args, window=window, **blocks).lower(lowering_platforms=("cuda",))
            assert "triton" in lowered.as_text().lower()
        entry = jax.jit(paged_attention, static_argnames="window")  # the dispatch entry's own launch config
        assert "triton" in entry.trace(*args, window=window).lower(lowering_platforms=("cuda",)).as_text().lower()
