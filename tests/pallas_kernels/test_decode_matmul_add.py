"""The decode output/down projection kernel with the residual add (``pallas_kernels/decode_matmul_add``): its
schedule (plain Python), its lowering for CUDA, the entry around it (padding, slicing, the fallback) with the
kernel computed by jnp, and the kernel's own numerics where a GPU is present (``scripts/gpu_validate.sh`` runs this
file there). Mosaic GPU's interpreter has no distributed shared memory, so the kernel does not run on the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from apriel2_jax.ops import decode_fused
from pallas_kernels import decode_gemv
from pallas_kernels import decode_matmul_add as dma

F32 = jnp.float32


def _operands(rows, k_dim, n_dim, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    bf = jnp.bfloat16
    x = jax.random.normal(k[0], (rows, k_dim)).astype(bf)
    weight = (0.03 * jax.random.normal(k[1], (n_dim, k_dim))).astype(bf)
    residual = jax.random.normal(k[2], (rows, n_dim)).astype(bf)
    return x, weight, residual


@pytest.mark.parametrize("rows, k_dim, n_dim, sms, want", [
    (32, 4864, 896, 132, (8, 5)),  # the 0.5B down projection: 14 tiles x 8, shares of 5 and 4 blocks
    (8, 896, 896, 132, (4, 2)),  # the 0.5B output projection: 7 blocks, so a cluster of 4 (every CTA a block)
    (13, 1024, 512, 132, (8, 1)),
    (8, 2048, 896, 64, (4, 4)),  # 14 tiles x 8 would exceed 64 SMs
    (8, 4864, 896, 64, None),  # and a cluster of 4 leaves shares of 10 blocks: too wide for the SMEM
    (33, 896, 896, 132, None),  # more rows than the kernel takes
    (8, 960, 896, 132, None),  # input width not a multiple of 128
    (8, 896, 900, 132, None),  # output width not a multiple of 64
    (8, 5120 * 4, 5120, 132, None),  # the 15B down projection: its shares do not fit the SMEM
])
def test_schedule_picks_a_cluster_or_declines(rows, k_dim, n_dim, sms, want):
    plan = dma.schedule(rows, k_dim, n_dim, sms)
    assert ((plan.cluster, plan.slots) if plan else None) == want
    if plan:
        assert plan.rows == -(-rows // 8) * 8
        assert plan.ctas <= sms and plan.smem_bytes() <= dma.SMEM_BYTES
        shares = [tuple(int(v) for v in plan.share(s)) for s in range(plan.cluster)]
        # the shares tile the input's blocks in order, none empty, none wider than the loop
        assert [first for first, _ in shares] == [sum(c for _, c in shares[:s]) for s in range(plan.cluster)]
        assert sum(c for _, c in shares) == plan.blocks and all(1 <= c <= plan.slots for _, c in shares)


@pytest.mark.parametrize("rows, k_dim, n_dim", [(32, 4864, 896), (8, 4864, 896), (16, 896, 896), (24, 1024, 512)])
def test_cross_lowers_for_cuda(rows, k_dim, n_dim):
    plan = dma.schedule(rows, k_dim, n_dim, 132)
    args = (jax.ShapeDtypeStruct((plan.rows, k_dim), jnp.bfloat16), jax.ShapeDtypeStruct((n_dim, k_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((plan.rows, n_dim), jnp.bfloat16))
    fn = jax.jit(lambda x, w, r: dma.matmul_add_kernel(x, w, r, plan=plan))
    # lowering runs Mosaic GPU's checks (wgmma operands, swizzles, the cluster's peer refs, the row slices)
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def _kernel_in_jnp(x, weight, residual, *, plan):
    """What the kernel computes, in jnp, from the rows padded to the schedule's."""
    assert x.shape == (plan.rows, plan.k_dim) and residual.shape == (plan.rows, plan.n_dim)
    return decode_fused.matmul_add(x, weight, residual)


@pytest.mark.parametrize("rows", [8, 13, 32])
def test_entry_pads_and_slices(rows, monkeypatch):
    monkeypatch.setattr(dma, "matmul_add_kernel", _kernel_in_jnp)
    x, weight, residual = _operands(rows, 256, 128)
    got = dma.matmul_add(x, weight, residual, sms=132)
    want = decode_fused.matmul_add(x, weight, residual)
    assert got.shape == want.shape == (rows, 128) and got.dtype == want.dtype
    assert jnp.array_equal(got, want)


def test_entry_falls_back_below_its_rows_and_outside_its_shapes(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel must not run here")

    calls = []

    def gemv_entry(x, weight, residual):  # decode_gemv's entry: its GEMV kernel at one or two rows, jnp elsewhere
        calls.append(x.shape)
        return decode_fused.matmul_add(x, weight, residual)

    monkeypatch.setattr(dma, "matmul_add_kernel", no_kernel)
    monkeypatch.setattr(decode_gemv, "matmul_add", gemv_entry)
    cases = [(1, 256, 128), (dma.MIN_ROWS - 1, 256, 128), (13, 200, 128), (13, 256, 100), (40, 256, 128),
             (13, 256, 256)]  # the last: an input no wider than the output (the output projection), XLA's
    for rows, k_dim, n_dim in cases:
        x, weight, residual = _operands(rows, k_dim, n_dim)
        got = dma.matmul_add(x, weight, residual, sms=132)
        assert jnp.array_equal(got, decode_fused.matmul_add(x, weight, residual))
    assert calls == [(rows, k_dim) for rows, k_dim, _ in cases]
    x, weight, residual = _operands(8, 256, 128)
    assert dma.plan_for(x.astype(F32), weight, residual, sms=132) is None  # float32 rows: not the kernel's
    assert dma.plan_for(x, weight, residual[:, :64], sms=132) is None  # a residual of the wrong width


def _assert_close_to_the_op(got, want):
    diff = jnp.abs(got.astype(F32) - want.astype(F32))
    # the op's roundings (the projection, then the add): equal but where an fp32 sum in another order lands on the
    # other side of a bf16 step
    assert float(jnp.max(diff)) <= 2 ** -6 * float(jnp.max(jnp.abs(want.astype(F32))))
    assert float(jnp.mean((diff > 0).astype(F32))) < 0.02


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="distributed shared memory: the GPU itself")
@pytest.mark.parametrize("rows", [8, 16, 32])
@pytest.mark.parametrize("k_dim, n_dim", [(4864, 896), (896, 896), (1024, 512)], ids=["down", "o_proj", "other"])
def test_kernel_matches_the_op_on_the_gpu(rows, k_dim, n_dim):
    x, weight, residual = _operands(rows, k_dim, n_dim, seed=rows)
    plan = dma.schedule(rows, k_dim, n_dim, jax.devices()[0].core_count)
    fn = jax.jit(lambda x, w, r: dma.matmul_add_kernel(x, w, r, plan=plan))
    got = fn(x, weight, residual)
    _assert_close_to_the_op(got, decode_fused.matmul_add(x, weight, residual))
    assert jnp.array_equal(fn(x, weight, residual), got)  # a fixed order of the partials' sum: the same every call


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="distributed shared memory: the GPU itself")
def test_entry_runs_the_kernel_on_the_gpu():
    x, weight, residual = _operands(13, 4864, 896)  # the 0.5B down projection, rows padded to 16
    assert dma.plan_for(x, weight, residual) is not None
    got = jax.jit(dma.matmul_add)(x, weight, residual)
    _assert_close_to_the_op(got, decode_fused.matmul_add(x, weight, residual))
