"""GDN/KDA decode kernel: interpret mode against the jnp op on CPU, and cross-lowering for CUDA at production
shapes (catches the Triton backend's power-of-two and layout rules without a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops.delta_rule import delta_rule_decode_slots, delta_rule_decode_slots_packed
from pallas_kernels.delta_rule_decode import (decode_slots, decode_slots_packed, delta_rule_decode,
                                              delta_rule_decode_packed, supported)


def _inputs(seed, kda, batch=3, key_heads=2, heads=4, key_dim=16, value_dim=32, pool=7, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    key_heads = heads if kda else key_heads
    g_shape = (batch, heads, key_dim) if kda else (batch, heads)
    return dict(
        q=f(batch, key_heads, key_dim),
        k=f(batch, key_heads, key_dim),
        v=f(batch, heads, value_dim),
        g=-jnp.asarray(rng.uniform(0.0, 5.0 if kda else 2.0, g_shape), jnp.float32),
        beta=jnp.asarray(rng.uniform(0.0, 1.0, (batch, heads)), jnp.float32),
        state_pool=jnp.asarray(rng.standard_normal((pool, heads, key_dim, value_dim)), jnp.float32),
        slots=jnp.asarray([5, 1, 3][:batch], jnp.int32),  # out of order, not contiguous
        fresh=jnp.asarray([False, True, False][:batch]),
    )


def _rel(a, b):
    return float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max() / jnp.abs(b.astype(jnp.float32)).max())


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("block_v, hp, slab_fastest", [(8, 1, False), (32, 1, True), (16, 2, True), (32, 4, False)])
def test_kernel_matches_reference_fp32(kda, block_v, hp, slab_fastest):
    x = _inputs(0, kda)
    o_ref, pool_ref = delta_rule_decode_slots(**x)
    o, pool = delta_rule_decode(**dict(x, state_pool=x["state_pool"].copy()), block_v=block_v, heads_per_program=hp,
                                slab_fastest=slab_fastest, interpret=True)
    assert _rel(o, o_ref) <= 1e-5 and _rel(pool, pool_ref) <= 1e-5
    untouched = np.setdiff1d(np.arange(7), np.asarray(x["slots"]))
    np.testing.assert_array_equal(np.asarray(pool)[untouched], np.asarray(x["state_pool"])[untouched])


def _packed(x):
    """GDN's conv output for ``x``'s q, k, v: [B, 2 H_k K + H V], q heads then k heads then v heads."""
    batch = x["q"].shape[0]
    return jnp.concatenate([x[n].reshape(batch, -1) for n in ("q", "k", "v")], axis=1)


@pytest.mark.parametrize("dtype, block_v, hp, tol", [(jnp.float32, 16, 2, 1e-5), (jnp.bfloat16, 32, 1, 1e-2)])
def test_packed_kernel_matches_the_unpacked_reference(dtype, block_v, hp, tol):
    x = _inputs(3, kda=False, dtype=dtype)
    o_ref, pool_ref = delta_rule_decode_slots(**x)
    rest = {n: x[n] for n in ("g", "beta", "slots", "fresh")}
    o_op, pool_op = delta_rule_decode_slots_packed(_packed(x), **rest, state_pool=x["state_pool"], key_heads=2,
                                                   key_dim=16)
    np.testing.assert_array_equal(np.asarray(o_op, np.float32), np.asarray(o_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(pool_op), np.asarray(pool_ref))
    o, pool = delta_rule_decode_packed(_packed(x), **rest, state_pool=x["state_pool"].copy(), key_heads=2, key_dim=16,
                                       block_v=block_v, heads_per_program=hp, interpret=True)
    assert o.shape == o_ref.shape and o.dtype == dtype
    assert _rel(o, o_ref) <= tol and _rel(pool, pool_ref) <= 1e-5
    untouched = np.setdiff1d(np.arange(7), np.asarray(x["slots"]))
    np.testing.assert_array_equal(np.asarray(pool)[untouched], np.asarray(x["state_pool"])[untouched])


def test_packed_buffer_of_the_wrong_width_is_refused():
    x = _inputs(3, kda=False)
    rest = {n: x[n] for n in ("g", "beta", "slots", "fresh")}
    mixed = _packed(x)[:, :-1]
    for fn in (delta_rule_decode_slots_packed, decode_slots_packed):
        with pytest.raises(ValueError, match="packed q"):
            fn(mixed, **rest, state_pool=x["state_pool"], key_heads=2, key_dim=16)


def test_fresh_rows_ignore_the_stale_slot_contents():
    x = _inputs(1, kda=False)
    o, pool = delta_rule_decode(**dict(x, state_pool=x["state_pool"].copy()), interpret=True)
    zeroed = x["state_pool"].at[1].set(0.0)  # row 1 is fresh and uses slot 1
    o2, pool2 = delta_rule_decode(**dict(x, state_pool=zeroed), interpret=True)
    np.testing.assert_allclose(np.asarray(o[1]), np.asarray(o2[1]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(pool[1]), np.asarray(pool2[1]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kda", [False, True])
def test_kernel_bf16_operands(kda):
    x = _inputs(2, kda, dtype=jnp.bfloat16)
    o_ref, pool_ref = delta_rule_decode_slots(**x)
    o, pool = delta_rule_decode(**dict(x, state_pool=x["state_pool"].copy()), interpret=True)
    assert o.dtype == jnp.bfloat16
    assert _rel(o, o_ref) <= 1e-2 and _rel(pool, pool_ref) <= 1e-5


def test_unsupported_shapes_fall_back_to_the_reference():
    x = _inputs(3, kda=False, key_dim=12, value_dim=24)
    assert not supported(x["q"], x["v"], x["g"][..., None])
    o, pool = decode_slots(**x)
    o_ref, pool_ref = delta_rule_decode_slots(**x)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))


@pytest.mark.parametrize("kda", [False, True])
def test_cross_lowers_for_cuda_at_production_shapes(kda):
    """SuperApriel geometry: 256 sequences, 32 value heads (GDN: 8 key heads), K = V = 128, bf16 operands."""
    S = jax.ShapeDtypeStruct
    batch, heads, key_heads, dim, pool = 256, 32, 32 if kda else 8, 128, 257
    args = (
        S((batch, key_heads, dim), jnp.bfloat16),
        S((batch, key_heads, dim), jnp.bfloat16),
        S((batch, heads, dim), jnp.bfloat16),
        S((batch, heads, dim) if kda else (batch, heads), jnp.float32),
        S((batch, heads), jnp.float32),
        S((pool, heads, dim, dim), jnp.float32),
        S((batch,), jnp.int32),
        S((batch,), jnp.bool_),
    )
    _assert_lowers_for_cuda(delta_rule_decode, args)


def _assert_lowers_for_cuda(fn, args, **kw):
    """``fn`` lowers for an H100 from this CPU as a Triton kernel that updates the pool in place."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        text = fn.trace(*args, **kw).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()
    assert "input_output_alias" in text or "tf.aliasing_output" in text


def test_packed_kernel_cross_lowers_for_cuda():
    """The 0.5B geometry's GDN: 32 rows, 14 value heads over 2 key heads, K = V = 64, bf16 operands."""
    S = jax.ShapeDtypeStruct
    batch, heads, key_heads, dim, pool = 32, 14, 2, 64, 33
    args = (
        S((batch, 2 * key_heads * dim + heads * dim), jnp.bfloat16),
        S((batch, heads), jnp.float32),
        S((batch, heads), jnp.float32),
        S((pool, heads, dim, dim), jnp.float32),
        S((batch,), jnp.int32),
        S((batch,), jnp.bool_),
    )
    _assert_lowers_for_cuda(delta_rule_decode_packed, args, key_heads=key_heads, key_dim=dim, block_v=64, num_warps=4)


def _gated_inputs(seed, kda, batch=3, heads=4, key_heads=2, dim=16, pool=7, dtype=jnp.bfloat16):
    """The gated ops' inputs as the modules hand them over: GDN's conv output and its projections' buffer
    (z and b|a at offsets, other columns around them), KDA's conv outputs, gate projections and a projections
    buffer holding the raw beta."""
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    common = dict(
        A_log=jnp.asarray(rng.uniform(-1.0, 1.0, heads), jnp.float32),
        norm_weight=f(dim),
        state_pool=jnp.asarray(rng.standard_normal((pool, heads, dim, dim)), jnp.float32),
        slots=jnp.asarray([5, 1, 3][:batch], jnp.int32),
        fresh=jnp.asarray([False, True, False][:batch]),
    )
    if kda:
        size, rank = heads * dim, 8
        weights = dict(f_b_weight=f(size, rank) * 0.3, g_b_weight=f(size, rank) * 0.3)
        return dict(common, **weights, q=f(batch, size), k=f(batch, size), v=f(batch, size),
                    proj=f(batch, 40 + 2 * rank + heads), dt_bias=jnp.asarray(rng.standard_normal(size), jnp.float32)), \
            dict(f_a_offset=40, g_a_offset=40 + rank, beta_offset=40 + 2 * rank, eps=1e-5, norm_activation="sigmoid")
    mixed = f(batch, 2 * key_heads * dim + heads * dim)
    proj = f(batch, 24 + heads * dim + 2 * heads + 8)
    return dict(common, mixed=mixed, proj=proj, dt_bias=jnp.asarray(rng.standard_normal(heads), jnp.float32)), \
        dict(key_heads=key_heads, key_dim=dim, z_offset=24, ba_offset=24 + heads * dim, eps=1e-5)


@pytest.mark.parametrize("kda", [False, True])
def test_gated_kernels_match_the_ops(kda):
    """The gated ops (the update with its gates from raw projections, KDA's low-rank gates' second projections
    too, and its gated output norm) against the chain of ops the module ran before (gate projections, gates,
    update, ``gated_rms_norm``); GDN's kernel against its op (KDA's runs its convs too:
    ``test_kda_conv_gated_kernel_matches_the_op``)."""
    from flax import nnx

    from apriel2_jax.modules.layers import Linear
    from apriel2_jax.ops.delta_rule import (gdn_decode_gated_slots, gdn_gate, kda_decode_gated_slots, kda_gate)
    from apriel2_jax.ops.norms import activation, gated_rms_norm
    from pallas_kernels.delta_rule_decode import gdn_decode_gated

    x, kw = _gated_inputs(4, kda)
    op = kda_decode_gated_slots if kda else gdn_decode_gated_slots
    y_ref, pool_ref = op(**x, **kw)
    if kda:
        shape = (3, 4, 16)
        g_raw = Linear(8, 64, False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        g_raw.weight[...] = x["f_b_weight"]
        gate = jnp.einsum("...i,oi->...o", x["proj"][:, 48:56], x["g_b_weight"])  # Linear's product
        g = kda_gate(g_raw(x["proj"][:, 40:48]).reshape(shape), x["A_log"], x["dt_bias"])
        beta = jax.nn.sigmoid(x["proj"][:, 56:60].astype(jnp.float32))
        o, pool = delta_rule_decode_slots(*(x[n].reshape(shape) for n in "qkv"), g, beta, x["state_pool"], x["slots"],
                                          x["fresh"])
        chain = gated_rms_norm(o, gate.reshape(shape), x["norm_weight"], 1e-5, "sigmoid")
    else:
        ba = x["proj"][:, 88:96]
        g, beta = gdn_gate(ba[:, 4:], x["A_log"], x["dt_bias"]), activation("sigmoid", ba[:, :4])
        o, pool = delta_rule_decode_slots_packed(x["mixed"], g, beta, x["state_pool"], x["slots"], x["fresh"],
                                                 key_heads=2, key_dim=16)
        chain = gated_rms_norm(o, x["proj"][:, 24:88].reshape(3, 4, 16), x["norm_weight"], 1e-5, "silu")
    np.testing.assert_array_equal(np.asarray(y_ref, np.float32), np.asarray(chain, np.float32))
    np.testing.assert_array_equal(np.asarray(pool_ref), np.asarray(pool))
    if kda:  # KDA's kernel runs its convs too: test_kda_conv_gated_kernel_matches_the_op
        return
    y, new_pool = gdn_decode_gated(**dict(x, state_pool=x["state_pool"].copy()), **kw, interpret=True)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert _rel(y, y_ref) <= 2e-2 and _rel(new_pool, pool_ref) <= 1e-5
    untouched = np.setdiff1d(np.arange(7), np.asarray(x["slots"]))
    np.testing.assert_array_equal(np.asarray(new_pool)[untouched], np.asarray(x["state_pool"])[untouched])


def test_gdn_gated_kernel_cross_lowers_for_cuda():
    """The 0.5B geometry's GDN, 32 rows: 14 value heads over 2 key heads, its q|k|v|z|b|a buffer, K = V = 64,
    bf16."""
    from pallas_kernels.delta_rule_decode import gdn_decode_gated

    S = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    batch, heads, dim, pool = 32, 14, 64, 33
    gdn = (S((batch, 1152), bf), S((batch, 2076), bf), S((heads,), f32), S((heads,), f32), S((dim,), bf),
           S((pool, heads, dim, dim), f32), S((batch,), jnp.int32), S((batch,), jnp.bool_))
    _assert_lowers_for_cuda(gdn_decode_gated, gdn, key_heads=2, key_dim=dim, z_offset=1152, ba_offset=2048, eps=1e-5)


def _conv_gated_inputs(seed, bias, batch=3, heads=4, dim=16, taps=4, pool=7):
    """KDA's whole decode inputs as the module hands them over: the six projections side by side (q, k, v first),
    the three convs with their pools (one of them fp32), the gated update's weights."""
    x, kw = _gated_inputs(seed, kda=True, batch=batch, heads=heads, dim=dim, pool=pool)
    rng = np.random.default_rng(seed + 1)
    size, rank = heads * dim, x["f_b_weight"].shape[1]
    proj = jnp.asarray(rng.standard_normal((batch, 3 * size + 2 * rank + heads)), jnp.bfloat16)
    for name in "qkv":
        del x[name]
    x.update(
        proj=proj,
        conv_weights=tuple(jnp.asarray(rng.standard_normal((size, taps)) * 0.5, jnp.bfloat16) for _ in range(3)),
        conv_biases=tuple(jnp.asarray(rng.standard_normal(size), jnp.bfloat16) if bias else None for _ in range(3)),
        conv_pools=tuple(jnp.asarray(rng.standard_normal((pool, taps - 1, size)), dt)
                         for dt in (jnp.bfloat16, jnp.bfloat16, jnp.float32)),
    )
    return x, dict(kw, f_a_offset=3 * size, g_a_offset=3 * size + rank, beta_offset=3 * size + 2 * rank)


@pytest.mark.parametrize("bias, early_loads", [(False, True), (True, False)])
def test_kda_conv_gated_kernel_matches_the_op(bias, early_loads):
    """KDA's convs, gates, update and output norm in one kernel, against the jnp op (the chain of the three conv
    ops and ``kda_decode_gated_slots`` the module ran before); only the rows' slots change. Both load orders
    (``early_loads``: the state slab and the gates' operands before the convs, or after)."""
    from apriel2_jax.ops.conv import causal_conv1d_decode_slots
    from apriel2_jax.ops.delta_rule import kda_decode_conv_gated_slots, kda_decode_gated_slots
    from pallas_kernels.delta_rule_decode import kda_decode_conv_gated

    x, kw = _conv_gated_inputs(6, bias)
    y_ref, pools_ref, state_ref = kda_decode_conv_gated_slots(**x, **kw)
    convs = [causal_conv1d_decode_slots(x["proj"], w, b, p, x["slots"], x["fresh"], x_offset=i * 64)
             for i, (w, b, p) in enumerate(zip(x["conv_weights"], x["conv_biases"], x["conv_pools"]))]
    rest = {n: x[n] for n in ("proj", "f_b_weight", "g_b_weight", "A_log", "dt_bias", "norm_weight", "state_pool",
                              "slots", "fresh")}
    y_chain, state_chain = kda_decode_gated_slots(*(c[0] for c in convs), **rest, **kw)
    np.testing.assert_array_equal(np.asarray(y_ref, np.float32), np.asarray(y_chain, np.float32))
    np.testing.assert_array_equal(np.asarray(state_ref), np.asarray(state_chain))

    copies = dict(x, state_pool=x["state_pool"].copy(), conv_pools=tuple(p.copy() for p in x["conv_pools"]))
    y, pools, state = kda_decode_conv_gated(**copies, **kw, early_loads=early_loads, interpret=True)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    # the convs' bf16 outputs may round one ulp apart (another order of the taps' sum), hence the state's bound
    assert _rel(y, y_ref) <= 2e-2 and _rel(state, state_ref) <= 3e-3
    for new, ref, old in zip(pools, pools_ref, x["conv_pools"]):
        assert new.dtype == old.dtype
        np.testing.assert_array_equal(np.asarray(new, np.float32), np.asarray(ref, np.float32))
    untouched = np.setdiff1d(np.arange(7), np.asarray(x["slots"]))
    np.testing.assert_array_equal(np.asarray(state)[untouched], np.asarray(x["state_pool"])[untouched])


def test_kda_conv_gated_kernel_cross_lowers_for_cuda():
    """The 0.5B geometry's KDA, 32 rows: 14 heads of 64, four taps, low-rank gates of width 64, bf16."""
    from pallas_kernels.delta_rule_decode import kda_decode_conv_gated

    S = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    batch, heads, dim, pool = 32, 14, 64, 33
    size = heads * dim
    args = (S((batch, 3 * size + 2 * dim + heads), bf), (S((size, 4), bf),) * 3, (None,) * 3,
            (S((pool, 3, size), bf),) * 3, S((size, dim), bf), S((size, dim), bf), S((heads,), f32), S((size,), f32),
            S((dim,), bf), S((pool, heads, dim, dim), f32), S((batch,), jnp.int32), S((batch,), jnp.bool_))
    _assert_lowers_for_cuda(kda_decode_conv_gated, args, f_a_offset=3 * size, g_a_offset=3 * size + dim,
                            beta_offset=3 * size + 2 * dim, eps=1e-5, norm_activation="sigmoid")
    # 448 programs: the late loads by default; the early ones (one row's 14 programs) lower too
    _assert_lowers_for_cuda(kda_decode_conv_gated, args, f_a_offset=3 * size, g_a_offset=3 * size + dim,
                            beta_offset=3 * size + 2 * dim, eps=1e-5, norm_activation="sigmoid", early_loads=True)
