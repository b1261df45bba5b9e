"""Chunked GDN/KDA prefill kernels: interpret mode against the jnp oracle on CPU (packed sequences, slot pool),
and cross-lowering for CUDA at production shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops.delta_rule import delta_rule_varlen_slots
from pallas_kernels.delta_rule_prefill import FUSED_CONFIG, delta_rule_prefill, prefill_slots

# Four sequences packed in 200 tokens: one crossing a chunk boundary, a single token in a fresh slot, one that
# starts mid-chunk, one that ends at the buffer's end (its last window is clamped), and an empty padding row.
STARTS = [0, 70, 71, 150, 200]
LENGTHS = [70, 1, 75, 50, 0]
SLOTS = [3, 1, 4, 2, 0]
FRESH = [False, True, False, False, False]


def _inputs(seed, kda, tokens=200, key_heads=2, heads=4, key_dim=16, value_dim=32, pool=6, dtype=jnp.float32,
            decay=3.0, rows=5):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    key_heads = heads if kda else key_heads
    g_shape = (tokens, heads, key_dim) if kda else (tokens, heads)
    return dict(
        q=f(tokens, key_heads, key_dim), k=f(tokens, key_heads, key_dim), v=f(tokens, heads, value_dim),
        g=-jnp.asarray(rng.uniform(0.0, decay, g_shape), jnp.float32),
        beta=jnp.asarray(rng.uniform(0.0, 1.0, (tokens, heads)), dtype),
        state_pool=jnp.asarray(rng.standard_normal((pool, heads, key_dim, value_dim)), jnp.float32),
        starts=jnp.asarray(STARTS[:rows], jnp.int32), lengths=jnp.asarray(LENGTHS[:rows], jnp.int32),
        slots=jnp.asarray(SLOTS[:rows], jnp.int32), fresh=jnp.asarray(FRESH[:rows]),
    )


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _run(x, **kw):
    return delta_rule_prefill(**dict(x, state_pool=jnp.array(x["state_pool"], copy=True)), interpret=True, **kw)


@pytest.mark.parametrize("kda, fuse_output", [(False, False), (True, False), (False, True), (True, True)])
def test_packed_sequences_match_the_oracle_fp32(kda, fuse_output):
    x = _inputs(0, kda, decay=20.0 if kda else 3.0)  # KDA: strong per-channel decay, no lower bound
    o_ref, pool_ref = delta_rule_varlen_slots(**x, max_len=80)
    o, pool = _run(x, block_v=(16, 32), fuse_output=fuse_output)
    assert _rel(o, o_ref) <= 1e-5 and _rel(pool, pool_ref) <= 1e-5
    assert not np.any(np.asarray(o)[146:150])  # the gap between sequences stays zero
    np.testing.assert_array_equal(np.asarray(pool)[5], np.asarray(x["state_pool"])[5])  # untouched slot


@pytest.mark.parametrize("span_limit", [-1.0, 1e30])
def test_kda_products_midpoint_and_bounded_forms_agree(span_limit):
    """Mild decay: a limit of 1e30 forces the midpoint form of every sub-block, -1 the bounded form."""
    x = _inputs(4, kda=True, decay=0.5, rows=4)
    o_ref, pool_ref = delta_rule_varlen_slots(**x, max_len=80)
    o, pool = _run(x, diag_span_limit=span_limit)
    assert _rel(o, o_ref) <= 1e-5 and _rel(pool, pool_ref) <= 1e-5


def test_kda_extreme_and_mild_channels_side_by_side():
    """Half the key channels decay by up to 100 nats per token (1600 over a 16-token sub-block: any single
    reference point overflows there), the other half hardly at all: kk and qk stay exact in both."""
    x = _inputs(4, kda=True, decay=0.01, rows=4)
    g = np.asarray(x["g"]).copy()
    g[:, :, ::2] = -np.random.default_rng(5).uniform(0.0, 100.0, g[:, :, ::2].shape)
    x["g"] = jnp.asarray(g)
    o_ref, pool_ref = delta_rule_varlen_slots(**x, max_len=80)
    o, pool = _run(x)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(pool)))
    assert _rel(o, o_ref) <= 1e-5 and _rel(pool, pool_ref) <= 1e-5


@pytest.mark.parametrize("kda", [False, True])
def test_bf16_operands(kda):
    x = _inputs(1, kda, dtype=jnp.bfloat16, rows=4)
    o_ref, pool_ref = delta_rule_varlen_slots(**x, max_len=80)
    o, pool = _run(x)
    assert o.dtype == jnp.bfloat16
    assert _rel(o, o_ref) <= 1e-2 and _rel(pool, pool_ref) <= 1e-2


def test_buffer_shorter_than_a_chunk_and_gaps_stay_zero():
    x = _inputs(2, kda=False, tokens=20, rows=1)
    x.update(starts=jnp.asarray([3], jnp.int32), lengths=jnp.asarray([13], jnp.int32))
    o_ref, pool_ref = delta_rule_varlen_slots(**x, max_len=16)
    o, pool = _run(x)
    assert _rel(o, o_ref) <= 1e-5 and _rel(pool, pool_ref) <= 1e-5
    assert not np.any(np.asarray(o)[:3]) and not np.any(np.asarray(o)[16:])


def test_unsupported_shapes_fall_back_to_the_oracle():
    x = _inputs(3, kda=False, key_dim=12, value_dim=24, rows=2)
    o, pool = prefill_slots(**x, max_len=70)
    o_ref, _ = delta_rule_varlen_slots(**x, max_len=70)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))


@pytest.mark.parametrize("kda, fuse_output", [(False, False), (True, False), (False, True)])
def test_cross_lowers_for_cuda_at_production_shapes(kda, fuse_output):
    """8 sequences in 8192 tokens, 32 value heads (GDN: 8 key heads), K = V = 128, bf16 operands."""
    S = jax.ShapeDtypeStruct
    tokens, heads, key_heads, dim, rows = 8192, 32, 32 if kda else 8, 128, 8
    args = (
        S((tokens, key_heads, dim), jnp.bfloat16), S((tokens, key_heads, dim), jnp.bfloat16),
        S((tokens, heads, dim), jnp.bfloat16),
        S((tokens, heads, dim) if kda else (tokens, heads), jnp.float32), S((tokens, heads), jnp.bfloat16),
        S((rows + 1, heads, dim, dim), jnp.float32),
        S((rows,), jnp.int32), S((rows,), jnp.int32), S((rows,), jnp.int32), S((rows,), jnp.bool_),
    )
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        config = FUSED_CONFIG if fuse_output else {}  # as dispatched; else the defaults
        lowered = delta_rule_prefill.trace(*args, **config).lower(
            lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.lower().count("triton") >= (2 if fuse_output else 3)  # the kernels
    assert "tf.aliasing_output" in text or "input_output_alias" in text  # the pool is updated in place


def test_kda_wide_keys_with_mild_and_strong_chunks():
    """K = 128 (two column slices in every kernel) and decay mild before token 100, strong after, so one call
    mixes sub-blocks of both forms of the products kernel."""
    x = _inputs(7, True, key_dim=128, value_dim=64, decay=0.5)
    g = np.asarray(x["g"]).copy()
    g[100:] = -np.random.default_rng(3).uniform(0.0, 20.0, g[100:].shape)
    x["g"] = jnp.asarray(g)
    o_ref, pool_ref = delta_rule_varlen_slots(**x, max_len=80)
    o, pool = _run(x, block_v=(16, 32))
    assert _rel(o, o_ref) <= 1e-5 and _rel(pool, pool_ref) <= 1e-5


def test_kda_value_heads_grouped_over_key_heads():
    """KDA with 4 value heads over 2 key heads (q/k read at head // 2 by the prepare and products kernels)."""
    x = _inputs(8, kda=True, decay=5.0, rows=4)
    x.update(q=x["q"][:, :2], k=x["k"][:, :2])
    o_ref, pool_ref = delta_rule_varlen_slots(**x, max_len=80)
    o, pool = _run(x, block_v=(16, 32))
    assert _rel(o, o_ref) <= 1e-5 and _rel(pool, pool_ref) <= 1e-5


def test_dispatch_config_follows_the_number_of_sequence_head_pairs():
    """Fused state+output for many (sequence, head) pairs (the B=8 H=32 benchmark has 256), narrow state slabs
    that still give about 128 programs for few, and fp32 on the tiles it was validated with."""
    from pallas_kernels.delta_rule_prefill import dispatch_config

    bf16 = jnp.bfloat16
    assert dispatch_config(8 * 32, 128, bf16) == FUSED_CONFIG
    assert dispatch_config(16, 128, bf16) == dict(block_v=(16, 128))
    assert dispatch_config(32, 128, bf16)["block_v"][0] == 32
    for pairs in (1, 5, 16, 40, 100, 127):
        config = dispatch_config(pairs, 64, bf16)
        assert not config.get("fuse_output") and 16 <= config["block_v"][0] <= 64
    assert not dispatch_config(8 * 32, 128, jnp.float32).get("fuse_output")


def test_blank_output_zeroes_exactly_the_rows_outside_every_sequence():
    """The output kernels write only the sequences' rows; ``blank_output`` must zero the others (padding, gaps,
    the tail). Interpret mode fills fresh outputs with NaN, so a row it missed shows. (That the sequences' rows are
    all written afterwards is test_packed_sequences_match_the_oracle_fp32's, whose layout has a gap.)"""
    from pallas_kernels.delta_rule_prefill import blank_output

    starts, lengths = jnp.array([3, 70, 150, 160], jnp.int32), jnp.array([50, 64, 0, 30], jnp.int32)
    blank = np.asarray(blank_output(starts, lengths, (200, 2, 16), jnp.float32, interpret=True))
    covered = np.zeros(200, bool)
    for s, n in zip(np.asarray(starts), np.asarray(lengths)):
        covered[s:s + n] = True
    np.testing.assert_array_equal(blank[~covered], 0.0)


def test_block_inverse_of_a_unit_lower_matrix():
    """KDA's inverse from 16x16 blocks against float64 on a 64x64 matrix whose
    entries are as large as beta k.k can make them (|entry| <= 1) and whose inverse has entries far from 1."""
    from pallas_kernels.delta_rule_prefill import SUB, _block_unit_lower_inverse

    rng = np.random.default_rng(5)
    a = np.tril(rng.uniform(-1.0, 1.0, (64, 64)), -1) * 0.6
    blocks = {(i, j): jnp.asarray(a[i * SUB:(i + 1) * SUB, j * SUB:(j + 1) * SUB], jnp.float32)
              for i in range(4) for j in range(i + 1)}
    x = _block_unit_lower_inverse(blocks, jax.lax.Precision.HIGHEST)
    expected = np.linalg.inv(np.eye(64) + a)
    got = np.zeros((64, 64))
    for (i, j), block in x.items():
        got[i * SUB:(i + 1) * SUB, j * SUB:(j + 1) * SUB] = np.asarray(block)
    assert np.abs(expected).max() > 3.0  # not a near-identity case
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
