"""The decode input-projections kernel (``pallas_kernels/decode_projections``): its schedule (plain Python), its
lowering for CUDA, the entry around it (the norm, padding and slicing, the fallback) with the kernel's product
computed by jnp, and the kernel's own numerics: in Mosaic GPU's interpret mode on the CPU (small shapes, several
projections of unequal widths), and at the 0.5B geometry where a GPU is present (``scripts/gpu_validate.sh``
runs this file there)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from apriel2_jax.ops import decode_fused
from pallas_kernels import decode_gemv
from pallas_kernels import decode_projections as dp

from .mosaic_interpret import gpu_interpret

F32 = jnp.float32


def _weights(hidden, widths, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), len(widths) + 1)
    bf = jnp.bfloat16
    norm = (1 + 0.1 * jax.random.normal(k[0], (hidden,))).astype(bf)
    return norm, tuple((0.03 * jax.random.normal(kk, (w, hidden))).astype(bf) for kk, w in zip(k[1:], widths))


@pytest.mark.parametrize("rows", [8, 13, 32])
def test_schedule_at_the_05b_geometry(rows):
    plan = dp.schedule(rows, 896, (896, 128, 128), 132)  # attention's Q, K and V
    assert plan.rows == -(-rows // 8) * 8
    assert plan.tile == 16 and plan.ctas == 72  # the narrowest tile dividing every width: the most CTAs
    assert plan.smem_bytes() <= dp.SMEM_BYTES


@pytest.mark.parametrize("rows, k_dim, widths, sms, want_tile", [
    (8, 896, (896, 128, 128), 64, 32),  # 72 tiles of 16 would exceed 64 SMs
    (8, 512, (640, 64, 64), 16, 64),  # 16 SMs: only tiles of 64 features (12 CTAs) fit one CTA per SM
    (32, 896, (896, 896, 896, 64, 64, 14), 132, 32),  # KDA: beta (14) padded to 32; tiles of 16 would be 177 CTAs
    (32, 896, (2048, 28), 132, 16),  # GDN: q|k|v|z and b|a (28) padded to 32: 130 CTAs
    (8, 896, (14, 64), 132, None),  # a narrow projection that is not the last: its padding would shift the next
    (33, 896, (896, 128, 128), 132, None),  # more rows than the kernel takes
    (8, 960, (896, 128, 128), 132, None),  # input width not a multiple of 128
    (8, 5120, (4096, 1024, 1024), 132, None),  # the 15B's rows and weights do not fit the SMEM
])
def test_schedule_picks_a_tile_or_declines(rows, k_dim, widths, sms, want_tile):
    plan = dp.schedule(rows, k_dim, widths, sms)
    assert (plan.tile if plan else None) == want_tile
    if plan:
        assert plan.ctas <= sms and plan.smem_bytes() <= dp.SMEM_BYTES
        assert plan.widths[:-1] == widths[:-1] and plan.widths[-1] % plan.tile == 0
        assert plan.features == sum(widths) and 0 <= plan.last_padding < plan.tile


@pytest.mark.parametrize("rows, k_dim, widths", [(8, 896, (896, 128, 128)), (32, 896, (896, 128, 128)),
                                                 (16, 256, (64, 32)), (32, 896, (896, 896, 896, 64, 64, 14)),
                                                 (32, 896, (2048, 28))])
def test_cross_lowers_for_cuda(rows, k_dim, widths):
    plan = dp.schedule(rows, k_dim, widths, 132)
    args = [jax.ShapeDtypeStruct((plan.rows, k_dim), jnp.bfloat16)]
    args += [jax.ShapeDtypeStruct((w, k_dim), jnp.bfloat16) for w in widths]  # a narrow last one as it is
    fn = jax.jit(lambda h, *ws: dp.projections(h, ws, plan=plan))
    # lowering runs Mosaic GPU's layout and transform checks (wgmma operands, swizzles, the row slices)
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def _projections_in_jnp(h, weights, *, plan):
    """What the kernel computes, in jnp, from the normalised rows padded to the schedule's: its columns past a
    narrow last projection's features are undefined (NaN here)."""
    assert h.shape == (plan.rows, plan.k_dim)
    assert tuple(w.shape[0] for w in weights) == (*plan.widths[:-1], plan.widths[-1] - plan.last_padding)
    out = jnp.concatenate([h @ w.T for w in weights], axis=-1)
    return jnp.pad(out, ((0, 0), (0, plan.last_padding)), constant_values=jnp.nan)


@pytest.mark.parametrize("rows, widths", [(8, (64, 32, 32)), (13, (64, 32, 32)), (32, (64, 32, 32)),
                                          (13, (64, 32, 14))])
@pytest.mark.parametrize("pad_columns", [False, True])
def test_entry_normalises_pads_and_slices(rows, widths, pad_columns, monkeypatch):
    monkeypatch.setattr(dp, "projections", _projections_in_jnp)
    norm, weights = _weights(256, widths)
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 256)).astype(jnp.bfloat16)
    got = dp.norm_projections(x, norm, 1e-5, weights, pad_columns, sms=132)
    want = decode_fused.norm_projections(x, norm, 1e-5, weights)
    # pad_columns keeps the last projection's padding to the tile (16 here), else the output is the op's shape
    padded = -(-widths[-1] // 16) * 16 - widths[-1] if pad_columns else 0
    assert got.shape == (rows, sum(widths) + padded) and want.shape == (rows, sum(widths))
    assert got.dtype == want.dtype
    assert jnp.array_equal(got[:, : sum(widths)], want)


def test_entry_falls_back_below_its_rows_and_outside_its_shapes(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel must not run here")

    calls = []

    def gemv_entry(x, *args):  # decode_gemv's entry: its GEMV kernel at one or two rows on a GPU, jnp elsewhere
        calls.append(x.shape[0])
        return decode_fused.norm_projections(x, *args)

    monkeypatch.setattr(dp, "projections", no_kernel)
    monkeypatch.setattr(decode_gemv, "norm_projections", gemv_entry)
    norm, weights = _weights(256, (64, 32, 14))
    # 14 features before 64: no tile divides the narrow projection, and it is not the last
    cases = ((1, (0, 1)), (dp.MIN_ROWS - 1, (0, 1)), (13, (2, 0)))
    for rows, which in cases:
        ws = tuple(weights[i] for i in which)
        x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 256)).astype(jnp.bfloat16)
        got = dp.norm_projections(x, norm, 1e-5, ws, sms=132)
        assert jnp.array_equal(got, decode_fused.norm_projections(x, norm, 1e-5, ws))
    assert calls == [rows for rows, _ in cases]
    x32 = jnp.ones((8, 256), F32)  # float32 rows: not the kernel's
    assert dp.plan_for(x32, norm, weights[:2], sms=132) is None


def _assert_close_to_the_op(got, want):
    diff = jnp.abs(got.astype(F32) - want.astype(F32))
    # the op's roundings: equal but where an fp32 sum in another order lands on the other side of a bf16 step
    assert float(jnp.max(diff)) <= 2 ** -7 * float(jnp.max(jnp.abs(want.astype(F32))))
    assert float(jnp.mean((diff > 0).astype(F32))) < 0.01


@pytest.mark.parametrize("rows, widths", [(8, (32, 16, 16)), (13, (32, 16, 14))])
def test_kernel_matches_the_op_in_interpret_mode(rows, widths):
    hidden = 384  # 3 input blocks; 4 CTAs over three projections of unequal widths, the last padded or not
    plan = dp.schedule(rows, hidden, widths, 132)
    assert plan.tile == 16 and plan.ctas == 4
    norm, weights = _weights(hidden, widths)
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, hidden)).astype(jnp.bfloat16)
    with gpu_interpret() as races_found:
        got = dp.norm_projections(x, norm, 1e-5, weights, sms=132)  # the entry: norm, row padding, kernel, slices
        assert not races_found()
        _assert_close_to_the_op(got, decode_fused.norm_projections(x, norm, 1e-5, weights))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the 0.5B geometry on the GPU itself")
@pytest.mark.parametrize("rows", [8, 13, 32])
@pytest.mark.parametrize("widths", [(896, 128, 128), (896, 896, 896, 64, 64, 14), (2048, 28)],
                         ids=["attention", "kda", "gdn"])
def test_kernel_matches_the_op_on_the_gpu(rows, widths):
    norm, weights = _weights(896, widths)
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 896)).astype(jnp.bfloat16)
    assert dp.plan_for(x, norm, weights) is not None
    got = jax.jit(functools.partial(dp.norm_projections, eps=1e-5))(x, norm, weights=weights)
    want = decode_fused.norm_projections(x, norm, 1e-5, weights)
    _assert_close_to_the_op(got, want)
    padded = jax.jit(functools.partial(dp.norm_projections, eps=1e-5, pad_columns=True))(x, norm, weights=weights)
    assert padded.shape[1] >= want.shape[1]
    assert jnp.array_equal(padded[:, : want.shape[1]], got)
