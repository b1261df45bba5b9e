"""Decode-step GEMV kernels (Triton backend): interpret mode against the jnp chains of
``apriel2_jax.ops.decode_fused`` at small shapes that hit every path (several rows, a ragged last tile of output
features, loads in several groups of chunks), the dispatch entries' fallbacks, and cross-lowering for CUDA at the
0.5B and 15B geometries. One compile per kernel and dtype: the interpreter costs ~0.2 s per call here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops import decode_fused as reference
from pallas_kernels import decode_gemv as kernels

# fp32 sums in fp32: rounding-level agreement. bf16: one rounding of the output apart at most.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """Interpret mode runs a kernel's dots as XLA ops on the default device; on an H200 the float32 case missed
    its 1e-5 tolerance there (a GPU may compute float32 dots at tf32). Cross-lowering for CUDA does not depend on
    the device."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _rand(rng, dtype):
    return lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_match_the_chains(dtype):
    f = _rand(np.random.default_rng(0), dtype)
    # 96 = 3 chunks of 32 loaded in groups of 2; 40 features: a ragged last tile of 16.
    rows, width, features = 3, 96, 40
    config = dict(chunk=32, depth=2, interpret=True)
    x, weight, residual, norm = f(rows, width), f(features, width), f(rows, features), f(width)
    for prefetch in (True, False):  # the next group's loads before this group's products, or after
        out = kernels.matmul_add_kernel(x, weight, residual, block_n=16, prefetch=prefetch, **config)
        assert out.shape == residual.shape and out.dtype == dtype
        assert _rel(out, reference.matmul_add(x, weight, residual)) <= TOLERANCE[dtype]
    # and at its default tiles of 4: 42 features end in a ragged tile of 2
    weight42, residual42 = f(42, width), f(rows, 42)
    out = kernels.matmul_add_kernel(x, weight42, residual42, **config)
    assert out.shape == residual42.shape and out.dtype == dtype
    assert _rel(out, reference.matmul_add(x, weight42, residual42)) <= TOLERANCE[dtype]

    # The gate/up kernel at its default tiles of 4 (42 features end in a ragged tile of 2) and at 16 (40: 8)
    for n, tiles in ((42, {}), (40, {"block_n": 16})):
        gate, up = f(n, width), f(n, width)
        out = kernels.norm_gated_mlp_kernel(x, norm, 1e-5, gate, up, "silu", **tiles, **config)
        assert out.shape == (rows, n) and out.dtype == dtype
        assert _rel(out, reference.norm_gated_mlp(x, norm, 1e-5, gate, up, "silu")) <= TOLERANCE[dtype]

    # Q/K/V-like widths (48 + 4 + 4) and a narrow gate projection (6, as GDN's b|a) beside them: each projection
    # in tiles of its own (4, 4, 4, 2).
    weights = (f(48, width), f(4, width), f(4, width), f(6, width))
    assert kernels._projection_tiles(tuple(w.shape[0] for w in weights)) == (4, 4, 4, 2)
    out = kernels.norm_projections_kernel(x, norm, 1e-5, weights, **config)
    assert out.shape == (rows, 62) and out.dtype == dtype
    assert _rel(out, reference.norm_projections(x, norm, 1e-5, weights)) <= TOLERANCE[dtype]


def test_gate_up_load_groups_change_no_output():
    """The groups of chunks loaded ahead only order the loads: at one row (the dispatched case) the gate/up
    kernel's output is bitwise the same at its default for a narrow input (2), at all chunks at once and at one.
    The default is 2 up to ``NARROW_INPUT_CHUNKS`` chunks (the 0.5B's 896 = 7 x 128) and 8 above (the 15B's 5120
    = 20 x 256)."""
    assert kernels.gated_mlp_depth(896, kernels._chunk(896, None)) == 2
    assert kernels.gated_mlp_depth(5120, kernels._chunk(5120, None)) == 8
    f = _rand(np.random.default_rng(1), jnp.bfloat16)
    x, norm, gate, up = f(1, 224), f(224), f(12, 224), f(12, 224)  # 7 chunks of 32
    outs = [np.asarray(kernels.norm_gated_mlp_kernel(x, norm, 1e-5, gate, up, "silu", chunk=32, depth=depth,
                                                     interpret=True), np.float32) for depth in (None, 7, 1)]
    assert kernels.gated_mlp_depth(224, 32) == 2
    assert all(np.array_equal(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize("rows, bias", [(1, False), (2, True)])
def test_norm_projections_conv_kernel_matches_the_op(rows, bias):
    """GDN's fused decode input: the projections kernel runs the conv (silu) on its first 32 features (eight tiles
    of the first projection's 48; b|a-like 6 beside it) and updates the rows' pool slots (a fresh row reads
    zeros). bf16 operands, a pool in fp32; the op is the chain of ``norm_projections`` and the conv op."""
    from apriel2_jax.ops.conv import causal_conv1d_decode_slots

    rng = np.random.default_rng(5)
    f = _rand(rng, jnp.bfloat16)
    x, norm, weights = f(rows, 96), f(96), (f(48, 96), f(6, 96))
    conv_w, conv_b = f(32, 4) * 0.5, f(32) if bias else None
    pool = jnp.asarray(rng.standard_normal((5, 3, 32)), jnp.float32)
    slots, fresh = jnp.asarray([3, 1][:rows], jnp.int32), jnp.asarray([False, True][:rows])
    out_ref, pool_ref = reference.norm_projections_conv(x, norm, 1e-5, weights, conv_w, conv_b, pool, slots, fresh)
    proj = reference.norm_projections(x, norm, 1e-5, weights)
    mixed, chain_pool = causal_conv1d_decode_slots(proj, conv_w, conv_b, pool, slots, fresh)
    np.testing.assert_array_equal(np.asarray(out_ref[:, :32], np.float32), np.asarray(mixed, np.float32))
    np.testing.assert_array_equal(np.asarray(out_ref[:, 32:], np.float32), np.asarray(proj[:, 32:], np.float32))
    np.testing.assert_array_equal(np.asarray(pool_ref), np.asarray(chain_pool))

    out, new_pool = kernels.norm_projections_conv_kernel(x, norm, 1e-5, weights, conv_w, conv_b,
                                                         jnp.array(pool, copy=True), slots, fresh, chunk=32, depth=2,
                                                         interpret=True)
    assert out.shape == out_ref.shape and out.dtype == out_ref.dtype
    # the projection may round one ulp apart from XLA's (summation order), and the conv reads it
    assert _rel(out[:, 32:], out_ref[:, 32:]) <= TOLERANCE[jnp.bfloat16]
    assert _rel(out[:, :32], out_ref[:, :32]) <= 3e-2
    assert _rel(new_pool, pool_ref) <= 1e-2
    untouched = np.setdiff1d(np.arange(5), np.asarray(slots))
    np.testing.assert_array_equal(np.asarray(new_pool)[untouched], np.asarray(pool)[untouched])
    with pytest.raises(ValueError, match="whole tiles"):
        kernels.norm_projections_conv_kernel(x, norm, 1e-5, weights, conv_w[:22], None, pool[..., :22], slots, fresh,
                                             interpret=True)


def test_dispatch_entries_fall_back_to_the_chains_for_shapes_the_kernels_do_not_take():
    f = _rand(np.random.default_rng(2), jnp.float32)
    x, weight, residual = f(2, 32), f(16, 32), f(2, 16)
    # A residual of another dtype, an activation the kernel lacks (erf GELU), an input width not a multiple of 16,
    # more rows than the kernels take.
    assert "residual" in kernels.matmul_add_unsupported(x, weight, residual.astype(jnp.bfloat16))
    assert "activation" in kernels.norm_gated_mlp_unsupported(x, f(32), 1e-5, weight, weight, "gelu")
    assert "multiple of 16" in kernels.norm_projections_unsupported(f(2, 24), f(24), 1e-5, (f(16, 24),))
    many = f(kernels.MAX_ROWS + 1, 32)
    assert "rows" in kernels.matmul_add_unsupported(many, weight, f(kernels.MAX_ROWS + 1, 16))
    # The entries above their row limit run the chain (no kernel is traced: this would fail off GPU otherwise).
    rows = max(kernels.KERNEL_ROWS.values()) + 1
    x, residual = f(rows, 32), f(rows, 16)
    np.testing.assert_array_equal(np.asarray(kernels.matmul_add(x, weight, residual)),
                                  np.asarray(reference.matmul_add(x, weight, residual)))
    norm = f(32)
    np.testing.assert_array_equal(np.asarray(kernels.norm_projections(x, norm, 1e-5, (weight, weight))),
                                  np.asarray(reference.norm_projections(x, norm, 1e-5, (weight, weight))))
    # Weights past the entries' limit per call run the chain too, at one row: the limit holds one weight of 2 KB,
    # not two (the entries count every weight of the call) nor one of 4 KB.
    with pytest.MonkeyPatch.context() as patch:
        limit = 3 * weight.size * weight.dtype.itemsize // 2
        patch.setattr(kernels, "KERNEL_MAX_WEIGHT_BYTES",
                      {op: dict.fromkeys(rows, limit) for op, rows in kernels.KERNEL_MAX_WEIGHT_BYTES.items()})
        x, wide, residual = f(1, 32), f(32, 32), f(1, 32)
        assert kernels.takes("matmul_add", None, 1, (weight,))
        assert not kernels.takes("matmul_add", None, 1, (wide,))
        assert not kernels.takes("norm_projections", None, 1, (weight, weight))
        np.testing.assert_array_equal(np.asarray(kernels.matmul_add(x, wide, residual)),
                                      np.asarray(reference.matmul_add(x, wide, residual)))
        np.testing.assert_array_equal(
            np.asarray(kernels.norm_gated_mlp(x, norm, 1e-5, weight, weight, "silu")),
            np.asarray(reference.norm_gated_mlp(x, norm, 1e-5, weight, weight, "silu")))
        np.testing.assert_array_equal(np.asarray(kernels.norm_projections(x, norm, 1e-5, (weight, weight))),
                                      np.asarray(reference.norm_projections(x, norm, 1e-5, (weight, weight))))
    with pytest.raises(ValueError, match="block_n=16 does not divide"):
        kernels.norm_projections_kernel(f(1, 32), f(32), 1e-5, (f(8, 32),), block_n=16, interpret=True)
    with pytest.raises(ValueError, match="between 1 and"):
        kernels.matmul_add_kernel(many, weight, f(kernels.MAX_ROWS + 1, 16), interpret=True)


def test_weight_limits_depend_on_op_and_rows():
    S = jax.ShapeDtypeStruct
    # Limits are per call (every weight counted), per op and per row count; rows without a limit take no kernel.
    down = S((2048, 5632), jnp.bfloat16)  # 23.1 MB: the down kernel won at one row and lost at two
    assert kernels.takes("matmul_add", None, 1, (down,))
    assert not kernels.takes("matmul_add", None, 2, (down,))
    gate = S((5632, 2048), jnp.bfloat16)
    assert kernels.takes("norm_gated_mlp", None, 1, (gate, gate))
    assert not kernels.takes("norm_gated_mlp", None, 2, (gate, gate))
    q, kv = S((2048, 2048), jnp.bfloat16), S((512, 2048), jnp.bfloat16)  # 12.6 MB: XLA's fusions were faster
    assert not kernels.takes("norm_projections", None, 1, (q, kv, kv))
    assert not kernels.takes("matmul_add", "x must be [rows, features]", 1, (S((16, 16), jnp.bfloat16),))
    # The 0.5B geometry's calls all take their kernels at one and two rows (KDA's six projections: 5.07 MB).
    kda = (S((896, 896), jnp.bfloat16),) * 3 + (S((64, 896), jnp.bfloat16),) * 2 + (S((14, 896), jnp.bfloat16),)
    for rows in (1, 2):
        assert kernels.takes("norm_projections", None, rows, kda)
        assert kernels.takes("matmul_add", None, rows, (S((896, 4864), jnp.bfloat16),))
    # The 15B's calls (42-294 MB) all run XLA.
    assert not kernels.takes("matmul_add", None, 1, (S((5120, 4096), jnp.bfloat16),))
    assert not kernels.takes("norm_gated_mlp", None, 1, (S((14336, 5120), jnp.bfloat16),) * 2)
    assert kernels.KERNEL_ROWS == {op: max(rows) for op, rows in kernels.KERNEL_MAX_WEIGHT_BYTES.items()}


@pytest.mark.parametrize("rows, width, heads, groups, head_dim, inner", [
    (1, 896, 14, 2, 64, 4864),  # apriel2-0.5b-shaped, B = 1
    (4, 5120, 32, 8, 128, 14336),  # superapriel-15b-shaped, B = 4
])
def test_cross_lowers_for_cuda_at_production_shapes(rows, width, heads, groups, head_dim, inner):
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    x, norm = S((rows, width), bf), S((width,), bf)
    _assert_lowers_for_cuda((
        (kernels.matmul_add_kernel, (S((rows, inner), bf), S((width, inner), bf), x)),
        (kernels.norm_gated_mlp_kernel, (x, norm, 1e-5, S((inner, width), bf), S((inner, width), bf), "silu")),
        (kernels.norm_projections_kernel, (x, norm, 1e-5, (S((heads * head_dim, width), bf),
                                                           S((groups * head_dim, width), bf),
                                                           S((groups * head_dim, width), bf)))),
        # GDN's input projections: q|k|v|z and the b|a gates (2 x value heads wide)
        (kernels.norm_projections_kernel, (x, norm, 1e-5, (S((2 * (groups + heads) * head_dim, width), bf),
                                                           S((2 * heads, width), bf)))),
        # ... with the conv on q|k|v (its pool aliased)
        (kernels.norm_projections_conv_kernel,
         (x, norm, 1e-5, (S((2 * (groups + heads) * head_dim, width), bf), S((2 * heads, width), bf)),
          S(((2 * groups + heads) * head_dim, 4), bf), None, S((9, 3, (2 * groups + heads) * head_dim), bf),
          S((rows,), jnp.int32), S((rows,), jnp.bool_))),
    ))


def test_ragged_last_tiles_cross_lower_for_cuda():
    """A width the 4-feature tiles do not divide takes the masked stores on the GPU (interpret mode writes spare
    columns instead): they must lower too."""
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    x, norm = S((1, 128), bf), S((128,), bf)
    _assert_lowers_for_cuda((
        (kernels.matmul_add_kernel, (x, S((42, 128), bf), S((1, 42), bf))),
        (kernels.norm_gated_mlp_kernel, (x, norm, 1e-5, S((42, 128), bf), S((42, 128), bf), "silu")),
    ))


def _assert_lowers_for_cuda(cases):
    """Each (kernel, abstract arguments) lowers for CUDA, on an abstract H100, to a Triton call."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        for fn, args in cases:
            text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert "triton" in text.lower()
