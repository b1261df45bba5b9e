"""Fused decode-step projections (Triton backend): interpret mode against the jnp chains of
``apriel2_jax.ops.decode_fused`` at small shapes that hit every mask (rows below the dot's 16, output features not a
multiple of the tile, an input width not a multiple of the block), and cross-lowering for CUDA at the 0.5B and 15B
geometries. One compile per kernel and dtype: the interpreter costs ~0.2 s per call here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops import decode_fused as reference
from apriel2_jax.ops.rope import rope_cos_sin
from pallas_kernels import decode_matmul as kernels

# fp32 runs IEEE dots: rounding-level agreement. bf16: one rounding of the output apart at most.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _rand(rng, dtype):
    return lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_add_and_gated_mlp_match_the_chains(dtype):
    f = _rand(np.random.default_rng(0), dtype)
    rows, width, features = 3, 96, 40  # 96: masked input blocks; 40: a partial tile of 16
    x, weight, residual = f(rows, width), f(features, width), f(rows, features)
    out = kernels.matmul_add_kernel(x, weight, residual, interpret=True)
    assert out.shape == residual.shape and out.dtype == dtype
    assert _rel(out, reference.matmul_add(x, weight, residual)) <= TOLERANCE[dtype]

    norm, gate, up = f(width), f(features, width), f(features, width)
    out = kernels.norm_gated_mlp_kernel(x, norm, 1e-5, gate, up, "silu", block_n=32, interpret=True)
    assert out.shape == (rows, features) and out.dtype == dtype
    assert _rel(out, reference.norm_gated_mlp(x, norm, 1e-5, gate, up, "silu")) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_qkv_rope_write_matches_the_chain_and_writes_only_its_slots(dtype):
    f = _rand(np.random.default_rng(1), dtype)
    rows, width, heads, groups, head_dim, pages, page_size = 3, 64, 4, 2, 32, 6, 4
    x, norm = f(rows, width), f(width)
    wq, wk, wv = f(heads * head_dim, width), f(groups * head_dim, width), f(groups * head_dim, width)
    cos, sin = rope_cos_sin(jnp.array([5, 9, 0]), head_dim, 10000.0, dtype)
    slots = jnp.array([7, 13, 2], jnp.int32)
    k_pages, v_pages = f(pages, page_size, groups, head_dim), f(pages, page_size, groups, head_dim)
    args = (x, norm, 1e-5, wq, wk, wv, cos, sin, slots, k_pages, v_pages)
    q, k_new, v_new = kernels.norm_qkv_rope_write_kernel(*args, interpret=True)
    q_ref, k_ref, v_ref = reference.norm_qkv_rope_write(*args)
    assert q.shape == (rows, heads, head_dim)
    for ours, expected in ((q, q_ref), (k_new, k_ref), (v_new, v_ref)):
        assert _rel(ours, expected) <= TOLERANCE[dtype]
    # Every other slot keeps its contents exactly.
    untouched = np.setdiff1d(np.arange(pages * page_size), np.asarray(slots))
    for new, old in ((k_new, k_pages), (v_new, v_pages)):
        flat_new = np.asarray(new, np.float32).reshape(pages * page_size, -1)
        flat_old = np.asarray(old, np.float32).reshape(pages * page_size, -1)
        np.testing.assert_array_equal(flat_new[untouched], flat_old[untouched])


def test_dispatch_entries_fall_back_to_the_chains_for_shapes_the_kernels_do_not_take():
    f = _rand(np.random.default_rng(2), jnp.float32)
    x, weight, residual = f(2, 32), f(16, 32), f(2, 16)
    # A residual of another dtype, an activation the kernel lacks (erf GELU), a head_dim not a multiple of 32.
    assert kernels.matmul_add_unsupported(x, weight, residual.astype(jnp.bfloat16)) is not None
    assert kernels.norm_gated_mlp_unsupported(x, f(32), 1e-5, weight, weight, "gelu") is not None
    cos, sin = rope_cos_sin(jnp.array([0, 1]), 16, 10000.0, jnp.float32)
    pages = f(2, 4, 1, 16)
    args = (x, f(32), 1e-5, f(32, 32), f(16, 32), f(16, 32), cos, sin, jnp.array([1, 2]), pages, pages)
    assert "head_dim" in kernels.norm_qkv_rope_write_unsupported(*args)
    q, _, _ = kernels.norm_qkv_rope_write(*args)  # the chain: no kernel is traced
    np.testing.assert_array_equal(np.asarray(q), np.asarray(reference.norm_qkv_rope_write(*args)[0]))
    with pytest.raises(ValueError, match="block_k"):
        kernels.matmul_add_kernel(x, weight, residual, block_k=24, interpret=True)
    with pytest.raises(ValueError, match="block_n"):
        kernels.matmul_add_kernel(x, weight, residual, block_n=8, interpret=True)


@pytest.mark.parametrize("rows, width, heads, groups, head_dim, inner", [
    (1, 896, 14, 2, 64, 4864),  # apriel2-0.5b-shaped, B = 1
    (32, 5120, 32, 8, 128, 14336),  # superapriel-15b-shaped, B = 32
])
def test_cross_lowers_for_cuda_at_production_shapes(rows, width, heads, groups, head_dim, inner):
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    x, norm = S((rows, width), bf), S((width,), bf)
    pages = S((1000, 16, groups, head_dim), bf)
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        for fn, args in (
            (kernels.matmul_add_kernel, (S((rows, inner), bf), S((width, inner), bf), x)),
            (kernels.norm_gated_mlp_kernel, (x, norm, 1e-5, S((inner, width), bf), S((inner, width), bf), "silu")),
            (kernels.norm_qkv_rope_write_kernel, (x, norm, 1e-5, S((heads * head_dim, width), bf),
                                                  S((groups * head_dim, width), bf), S((groups * head_dim, width), bf),
                                                  S((rows, head_dim), bf), S((rows, head_dim), bf),
                                                  S((rows,), jnp.int32), pages, pages)),
        ):
            text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert "triton" in text.lower()
