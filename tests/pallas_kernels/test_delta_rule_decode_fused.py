"""Fused GDN/KDA decode (conv + gates + delta update in one kernel): interpret mode against the composed jnp
oracle, and cross-lowering for CUDA at production shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops.delta_rule import gdn_decode_fused_slots, kda_decode_fused_slots
from pallas_kernels.delta_rule_decode_fused import gdn_decode_fused, kda_decode_fused

BATCH, HEADS, DIM, TAPS, POOL = 3, 4, 16, 4, 6
SLOTS = jnp.asarray([5, 1, 3], jnp.int32)  # out of order
FRESH = jnp.asarray([False, True, False])


def _rng_arrays(seed, dtype):
    rng = np.random.default_rng(seed)
    return rng, (lambda *s: jnp.asarray(rng.standard_normal(s), dtype))  # noqa: E731


def _gdn_inputs(seed, dtype=jnp.float32, key_heads=2, dim=DIM):
    rng, f = _rng_arrays(seed, dtype)
    channels = 2 * key_heads * dim + HEADS * dim
    return dict(
        qkv=f(BATCH, channels), conv_weight=f(channels, TAPS) * 0.5, conv_pool=f(POOL, TAPS - 1, channels),
        a=f(BATCH, HEADS), b=f(BATCH, HEADS), A_log=jnp.log(jnp.linspace(1.0, 8.0, HEADS)),
        dt_bias=jnp.asarray(rng.standard_normal(HEADS), jnp.float32),
        state_pool=jnp.asarray(rng.standard_normal((POOL, HEADS, dim, dim)), jnp.float32),
        slots=SLOTS, fresh=FRESH,
    )


def _kda_inputs(seed, dtype=jnp.float32):
    rng, f = _rng_arrays(seed, dtype)
    size = HEADS * DIM
    return dict(
        q=f(BATCH, size), k=f(BATCH, size), v=f(BATCH, size),
        conv_weights=tuple(f(size, TAPS) * 0.5 for _ in range(3)),
        conv_pools=tuple(f(POOL, TAPS - 1, size) for _ in range(3)),
        g_raw=f(BATCH, HEADS, DIM), beta=jnp.asarray(rng.uniform(0, 1, (BATCH, HEADS)), jnp.float32),
        A_log=jnp.log(jnp.linspace(1.0, 16.0, HEADS)), dt_bias=jnp.asarray(rng.standard_normal(size), jnp.float32),
        state_pool=jnp.asarray(rng.standard_normal((POOL, HEADS, DIM, DIM)), jnp.float32),
        slots=SLOTS, fresh=FRESH,
    )


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_gdn_matches_the_oracle(dtype, tol):
    x = _gdn_inputs(0, dtype)
    o_ref, conv_ref, pool_ref = gdn_decode_fused_slots(**x, key_heads=2)
    o, conv, pool = gdn_decode_fused(**dict(x, state_pool=jnp.array(x["state_pool"], copy=True)), key_heads=2,
                                     block_v=8, heads_per_program=2, interpret=True)
    assert _rel(o, o_ref) <= tol and _rel(pool, pool_ref) <= max(tol, 1e-5)
    np.testing.assert_array_equal(np.asarray(conv, np.float32), np.asarray(conv_ref, np.float32))
    untouched = [0, 2, 4]
    np.testing.assert_array_equal(np.asarray(pool)[untouched], np.asarray(x["state_pool"])[untouched])


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_kda_matches_the_oracle(dtype, tol):
    x = _kda_inputs(1, dtype)
    o_ref, convs_ref, pool_ref = kda_decode_fused_slots(**x)
    o, convs, pool = kda_decode_fused(**dict(x, state_pool=jnp.array(x["state_pool"], copy=True)), block_v=16,
                                      interpret=True)
    assert _rel(o, o_ref) <= tol and _rel(pool, pool_ref) <= max(tol, 1e-5)
    for c, c_ref in zip(convs, convs_ref):
        np.testing.assert_array_equal(np.asarray(c, np.float32), np.asarray(c_ref, np.float32))


@pytest.mark.parametrize("kda", [False, True])
def test_cross_lowers_for_cuda_at_production_shapes(kda):
    """256 rows, 32 value heads (GDN: 8 key heads), K = V = 128, conv of 4 taps, bf16."""
    S = jax.ShapeDtypeStruct
    batch, heads, dim, pool, taps, bf = 256, 32, 128, 257, 4, jnp.bfloat16
    if kda:
        size = heads * dim
        fn = jax.jit(lambda *a: kda_decode_fused(*a[:3], a[3:6], a[6:9], *a[9:]))
        args = ([S((batch, size), bf)] * 3 + [S((size, taps), bf)] * 3 + [S((pool, taps - 1, size), bf)] * 3
                + [S((batch, heads, dim), bf), S((batch, heads), jnp.float32), S((heads,), jnp.float32),
                   S((size,), jnp.float32)])
    else:
        channels = 2 * 8 * dim + heads * dim
        fn = jax.jit(lambda *a: gdn_decode_fused(*a, key_heads=8))
        args = [S((batch, channels), bf), S((channels, taps), bf), S((pool, taps - 1, channels), bf),
                S((batch, heads), bf), S((batch, heads), bf), S((heads,), jnp.float32), S((heads,), jnp.float32)]
    args += [S((pool, heads, dim, dim), jnp.float32), S((batch,), jnp.int32), S((batch,), jnp.bool_)]
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


def test_unsupported_shapes_fall_back_to_the_oracle():
    x = _gdn_inputs(2, dim=12)  # not a power of two
    o, conv, pool = gdn_decode_fused(**dict(x, state_pool=jnp.array(x["state_pool"], copy=True)), key_heads=2)
    o_ref, conv_ref, pool_ref = gdn_decode_fused_slots(**x, key_heads=2)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
    np.testing.assert_array_equal(np.asarray(pool), np.asarray(pool_ref))
