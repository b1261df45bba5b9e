"""The TMA paged decode attention kernel (``pallas_kernels/paged_attention_decode_tma``, Mosaic GPU): its numerics
against the jnp reference in Mosaic GPU's interpret mode on the CPU (contexts of several ring refills, an empty
table entry, a padding row, a NaN sink page), its lowering for CUDA at the 0.5B geometry, and what it refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops.paged_attention import paged_attention as reference
from pallas_kernels import paged_attention_decode_tma as tma

from .mosaic_interpret import gpu_interpret

HEADS, GROUPS = 14, 2


def _inputs(page_size, head_dim, seed=0):
    """Three rows over a pool of 64 pages: row 0 sees 24 pages but its last (keys past its position), row 1 has
    an empty entry inside its context, row 2 is padding (a table of sink pages). The sink page holds NaN: no kernel
    may read it into a product."""
    rng = np.random.default_rng(seed)
    width = 384 // page_size + 1
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)  # noqa: E731
    perm = rng.permutation(np.arange(1, 64))
    table = np.zeros((3, width), np.int32)
    table[0, : width - 1] = perm[: width - 1]
    table[1, : width // 2] = perm[width : width + width // 2]
    table[1, 2] = 0
    positions = np.array([384 - 5, (width // 2) * page_size - 3, 0], np.int32)
    k_pages, v_pages = (f(64, page_size, GROUPS, head_dim).at[0].set(jnp.nan) for _ in range(2))
    return dict(q=f(3, 1, HEADS, head_dim), k_pages=k_pages, v_pages=v_pages, block_table=jnp.asarray(table),
                first_page=jnp.zeros((3,), jnp.int32), q_positions=jnp.asarray(positions[:, None]))


@pytest.mark.parametrize("page_size, head_dim, splits, depth, block",
                         [(16, 64, 1, 2, 64), (32, 128, 2, 3, 64), (16, 64, 2, 2, 128)])
def test_matches_the_reference_in_interpret_mode(page_size, head_dim, splits, depth, block):
    x = _inputs(page_size, head_dim)
    with gpu_interpret() as races_found:
        out = tma.paged_attention_decode_tma(**x, splits=splits, depth=depth, block=block)
        assert not races_found()
    out = np.asarray(out, np.float32)
    assert out.shape == x["q"].shape
    # the reference with a finite sink page (it masks the sink's scores but multiplies its values)
    finite = {**x, "k_pages": x["k_pages"].at[0].set(0), "v_pages": x["v_pages"].at[0].set(0)}
    want = np.asarray(reference(**finite), np.float32)
    assert np.abs(out[:2] - want[:2]).max() <= 1e-2 * np.abs(want[:2]).max()
    np.testing.assert_array_equal(out[2], 0.0)  # the padding row sees no key: zeros, no NaN


@pytest.mark.parametrize("b", [32, 3])  # 3 rows: the positions' copy is padded to whole 16 bytes
def test_cross_lowers_for_cuda_at_the_05b_geometry(b):
    width, pages = 73, 4096
    args = [jax.ShapeDtypeStruct((b, 1, HEADS, 64), jnp.bfloat16),
            *(jax.ShapeDtypeStruct((pages, 16, GROUPS, 64), jnp.bfloat16) for _ in range(2)),
            jax.ShapeDtypeStruct((b, width), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, 1), jnp.int32)]
    text = jax.jit(tma.paged_attention_decode_tma).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("change, words", [
    (dict(window=64), "sliding windows"),
    (dict(dtype=jnp.float32), "bf16 only"),
    (dict(head_dim=32), "head_dim 32"),
    (dict(page_size=128), "page_size 128"),
])
def test_refuses_what_it_does_not_handle(change, words):
    page_size, head_dim = change.get("page_size", 16), change.get("head_dim", 64)
    dtype = change.get("dtype", jnp.bfloat16)
    q = jnp.zeros((2, 1, HEADS, head_dim), dtype)
    pages = jnp.zeros((8, page_size, GROUPS, head_dim), dtype)
    with pytest.raises(ValueError, match=words):
        tma.paged_attention_decode_tma(q, pages, pages, jnp.zeros((2, 4), jnp.int32), jnp.zeros((2,), jnp.int32),
                                       jnp.zeros((2, 1), jnp.int32), window=change.get("window"))
