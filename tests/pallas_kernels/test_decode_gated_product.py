"""The decode gate/up + activation product kernel (``pallas_kernels/decode_gated_product``): its schedule (plain
Python), its lowering for CUDA, the entry around it (the norm, padding and slicing, the fallback) with the
kernel's product computed by jnp, and the kernel's own numerics: in Mosaic GPU's interpret mode on the CPU (small
shapes, a two-stage ring so that it refills), and at the 0.5B geometry where a GPU is present
(``scripts/gpu_validate.sh`` runs this file there)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from apriel2_jax.ops import decode_fused
from apriel2_jax.ops.norms import activation, rms_norm
from pallas_kernels import decode_gated_product as gp
from pallas_kernels import decode_gemv

from .mosaic_interpret import gpu_interpret

F32 = jnp.float32


def _weights(hidden, inter, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    bf = jnp.bfloat16
    norm = (1 + 0.1 * jax.random.normal(k[0], (hidden,))).astype(bf)
    gate, up = [(0.03 * jax.random.normal(kk, (inter, hidden))).astype(bf) for kk in k[1:]]
    return norm, gate, up


@pytest.mark.parametrize("rows", [8, 13, 32])
def test_schedule_fits_an_h200_at_the_05b_geometry(rows):
    plan = gp.schedule(rows, 896, 4864, 132)
    assert plan.rows == -(-rows // 8) * 8
    assert plan.ctas == 4864 // gp.TILE  # one CTA per 64 intermediate features, of both projections
    assert plan.smem_bytes() <= gp.SMEM_BYTES
    # as many (gate, up) stages as fit, and at least two: the loop refills a stage a step after reading it
    bigger = gp.Schedule(plan.rows, 896, 4864, plan.depth + 1)
    assert plan.depth == 896 // gp.BLOCK_K or bigger.smem_bytes() > gp.SMEM_BYTES
    assert plan.depth >= 2


@pytest.mark.parametrize("rows, hidden, inter, sms, why", [
    (33, 896, 4864, 132, "more rows than the kernel takes"),
    (8, 5120, 14336, 132, "15B: 224 feature CTAs on 132 SMs"),
    (8, 960, 4864, 132, "hidden width not a multiple of 128"),
    (8, 896, 4832, 132, "intermediate width not a multiple of 64"),
    (32, 4096, 4096, 132, "32 rows of a 4096-wide input leave no SMEM for two gate/up stages"),
])
def test_schedule_declines_what_it_cannot_run(rows, hidden, inter, sms, why):
    assert gp.schedule(rows, hidden, inter, sms) is None, why


@pytest.mark.parametrize("rows, hidden, inter", [(8, 896, 4864), (32, 896, 4864), (16, 256, 512)])
def test_cross_lowers_for_cuda(rows, hidden, inter):
    plan = gp.schedule(rows, hidden, inter, 132)
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((plan.rows, hidden), (inter, hidden), (inter, hidden))]
    fn = jax.jit(functools.partial(gp.gated_product, act="silu", plan=plan))
    # lowering runs Mosaic GPU's layout and transform checks (wgmma operands, swizzles, the transposed store)
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def _product_in_jnp(h, w_gate, w_up, *, act, plan):
    """What the kernel computes, in jnp, from the normalised rows padded to the schedule's."""
    assert h.shape == (plan.rows, plan.hidden)
    return activation(act, (h @ w_gate.T).astype(h.dtype)) * (h @ w_up.T).astype(h.dtype)


@pytest.mark.parametrize("rows", [8, 13, 32])
def test_entry_normalises_pads_and_slices(rows, monkeypatch):
    monkeypatch.setattr(gp, "gated_product", _product_in_jnp)
    norm, gate, up = _weights(256, 512)
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 256)).astype(jnp.bfloat16)
    got = gp.norm_gated_mlp(x, norm, 1e-5, gate, up, "silu", sms=132)
    want = decode_fused.norm_gated_mlp(x, norm, 1e-5, gate, up, "silu")
    assert got.shape == want.shape == (rows, 512) and got.dtype == want.dtype
    assert jnp.array_equal(got, want)


def test_entry_falls_back_below_its_rows_and_outside_its_shapes(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel must not run here")

    calls = []

    def gemv_entry(x, *args):  # decode_gemv's entry: its GEMV kernel at one row on a GPU, the jnp op elsewhere
        calls.append(x.shape[0])
        return decode_fused.norm_gated_mlp(x, *args)

    monkeypatch.setattr(gp, "gated_product", no_kernel)
    monkeypatch.setattr(decode_gemv, "norm_gated_mlp", gemv_entry)
    norm, gate, up = _weights(256, 512)
    cases = ((1, 132), (gp.MIN_ROWS - 1, 132), (13, 4))  # 4 SMs: fewer than the feature tiles
    for rows, sms in cases:
        x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 256)).astype(jnp.bfloat16)
        got = gp.norm_gated_mlp(x, norm, 1e-5, gate, up, "silu", sms=sms)
        assert jnp.array_equal(got, decode_fused.norm_gated_mlp(x, norm, 1e-5, gate, up, "silu"))
    assert calls == [rows for rows, _ in cases]
    x32 = jnp.ones((8, 256), F32)  # float32 rows: not the kernel's
    assert gp.plan_for(x32, norm, gate, up, "silu", sms=132) is None


@pytest.mark.parametrize("rows, act", [(8, "silu"), (13, "gelu_pytorch_tanh")])
def test_kernel_matches_the_op_in_interpret_mode(rows, act):
    hidden, inter = 640, 192  # 3 feature CTAs; 5 input blocks through 2 ring stages: every stage refilled
    plan = gp.Schedule(-(-rows // 8) * 8, hidden, inter, depth=2)
    norm, gate, up = _weights(hidden, inter)
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, hidden)).astype(jnp.bfloat16)
    with gpu_interpret() as races_found:
        h = rms_norm(jnp.pad(x, ((0, plan.rows - rows), (0, 0))), norm, 1e-5)
        got = gp.gated_product(h, gate, up, act=act, plan=plan)[:rows]
        assert not races_found()
        want = decode_fused.norm_gated_mlp(x, norm, 1e-5, gate, up, act)
    diff = jnp.abs(got.astype(F32) - want.astype(F32))
    # the op's roundings: equal but where an fp32 sum in another order lands on the other side of a bf16 step
    assert float(jnp.max(diff)) <= 2 ** -7 * float(jnp.max(jnp.abs(want.astype(F32))))
    assert float(jnp.mean((diff > 0).astype(F32))) < 0.01


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the 0.5B geometry on the GPU itself")
@pytest.mark.parametrize("rows", [8, 13, 32])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_kernel_matches_the_op_on_the_gpu(rows, act):
    norm, gate, up = _weights(896, 4864)
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 896)).astype(jnp.bfloat16)
    got = jax.jit(functools.partial(gp.norm_gated_mlp, eps=1e-5, act=act))(x, norm, w_gate=gate, w_up=up)
    want = decode_fused.norm_gated_mlp(x, norm, 1e-5, gate, up, act)
    # the same roundings as the op: at most one bf16 step apart where the GEMMs' fp32 sums differ in order
    diff = jnp.abs(got.astype(F32) - want.astype(F32))
    assert float(jnp.max(diff)) <= 2 ** -7 * float(jnp.max(jnp.abs(want.astype(F32))))
