"""The persistent decode MLP kernel (``pallas_kernels/decode_mlp``): its schedule (plain Python), its lowering for
CUDA, and the entry around it (padding, rounding, the residual add, the fallback) with the kernel's sum computed
by jnp. Mosaic GPU kernels with grid-wide semaphores have no CPU interpreter: the kernel's own numerics are checked
where a GPU is present. The engine's wiring of the whole-MLP op is checked in ``tests/modules/test_fused_decode.py``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from apriel2_jax import dispatch
from apriel2_jax.dispatch import lowered_once
from apriel2_jax.ops import decode_fused
from apriel2_jax.ops.norms import activation
from pallas_kernels import decode_mlp

F32 = jnp.float32


def _mlp_weights(hidden, inter, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    bf = jnp.bfloat16
    norm = (1 + 0.1 * jax.random.normal(k[0], (hidden,))).astype(bf)
    gate, up = [(0.03 * jax.random.normal(kk, (inter, hidden))).astype(bf) for kk in k[1:3]]
    down = (0.03 * jax.random.normal(k[3], (hidden, inter))).astype(bf)
    return norm, gate, up, down


def test_schedule_fits_an_h200_at_the_05b_geometry():
    plan = decode_mlp.schedule(1, 896, 4864, 132)
    assert plan.rows == 8
    assert plan.gate_up_ctas == 76 and plan.programs == 77  # one CTA per 64 intermediate features, one zeroing
    assert plan.down_depth == decode_mlp.DOWN_DEPTH
    assert plan.gate_up_depth >= 4  # most of a CTA's seven (gate, up) pairs load at once


@pytest.mark.parametrize("rows", [1, 8, 13, 32])
def test_schedule_stays_within_shared_memory(rows):
    plan = decode_mlp.schedule(rows, 896, 4864, 132)
    assert plan.smem_bytes() <= decode_mlp.SMEM_BYTES
    # the next (gate, up) stage would not fit
    bigger = decode_mlp.Schedule(plan.rows, 896, 4864, plan.gate_up_depth + 1, plan.down_depth)
    assert plan.gate_up_depth == 896 // decode_mlp.BLOCK_K or bigger.smem_bytes() > decode_mlp.SMEM_BYTES
    # the gate/up loop refills a stage a step after reading it: one stage of seven blocks would deadlock
    assert plan.gate_up_depth >= 2 and plan.down_depth >= 1
    assert plan.rows == -(-rows // 8) * 8


def test_schedule_gives_down_stages_back_for_a_second_gate_up_stage():
    blocks = 896 // (2 * decode_mlp.TILE)  # the CTA's down blocks: all of them asked for
    full = decode_mlp.Schedule(32, 896, 4864, 1, blocks)
    gate_up_stage = 2 * decode_mlp.TILE * decode_mlp.BLOCK_K * 2  # a (gate, up) pair of bf16 blocks
    assert full.smem_bytes() + gate_up_stage > decode_mlp.SMEM_BYTES  # all down stages leave room for one
    plan = decode_mlp.schedule(32, 896, 4864, 132, down_depth=blocks)
    assert plan.down_depth < blocks and plan.gate_up_depth >= 2
    assert plan.smem_bytes() <= decode_mlp.SMEM_BYTES


@pytest.mark.parametrize("rows", [8, 32])
def test_output_blocks_reuse_the_gate_up_stages(rows):
    """The down loop's float32 output blocks live in the bytes the (gate, up) stages held: at 8 rows one per down
    block (no store waits for another), at 32 rows as many as fit."""
    plan = decode_mlp.schedule(rows, 896, 4864, 132)
    block = 2 * decode_mlp.TILE * plan.rows * 4
    stages = plan.gate_up_depth * 2 * decode_mlp.TILE * decode_mlp.BLOCK_K * 2
    fixed = decode_mlp.Schedule(plan.rows, 896, 4864, 0, plan.down_depth).smem_bytes() - 2 * block
    assert 2 <= plan.out_depth <= 896 // (2 * decode_mlp.TILE)
    assert plan.out_depth * block <= stages
    assert plan.smem_bytes() == fixed + stages
    if rows == 8:
        assert plan.out_depth == 896 // (2 * decode_mlp.TILE)
    else:
        assert (plan.out_depth + 1) * block > stages


@pytest.mark.parametrize("rows", [1, 8, 16, 32])
def test_down_loads_queue_behind_every_gate_up_load(rows):
    """An SM's copies land in issue order, so the down blocks are issued at the gate/up step that issues the last
    (gate, up) pair (the loop refills step ``s - 1 + depth`` at step ``s``), not ahead of the pairs."""
    plan = decode_mlp.schedule(rows, 896, 4864, 132)
    steps = 896 // decode_mlp.BLOCK_K
    assert plan.down_issue_step - 1 + plan.gate_up_depth == steps - 1
    whole = decode_mlp.schedule(rows, 256, 512, 132)  # every pair issued before the loop: so are the down blocks
    assert whole.gate_up_depth == 256 // decode_mlp.BLOCK_K and whole.down_issue_step == 0


@pytest.mark.parametrize("rows", [1, 8, 16, 32])
def test_down_groups_fit_the_registers_and_never_wrap(rows):
    plan = decode_mlp.schedule(rows, 896, 4864, 132)
    n = plan.down_group
    assert n == 1 or n * plan.rows <= decode_mlp.GROUP_REGS
    for j in range(0, plan.down_blocks, n):  # each group's blocks sit side by side in the ring and the outputs
        m = min(n, plan.down_blocks - j)
        assert j % plan.down_depth + m <= plan.down_depth
        assert j % plan.out_depth + m <= plan.out_depth


@pytest.mark.parametrize("rows, hidden, inter, sms, why", [
    (33, 896, 4864, 132, "more rows than the kernel takes"),
    (1, 5120, 14336, 132, "15B: 224 feature CTAs on 132 SMs"),
    (1, 896, 4864, 76, "too few SMs for a CTA per feature tile and the zeroing CTA"),
    (1, 960, 4864, 132, "hidden width not a multiple of 128"),
    (1, 896, 4832, 132, "intermediate width not a multiple of 64"),
    (32, 3072, 4096, 132, "32 rows of a 3072-wide input leave no SMEM for a gate/up stage"),
])
def test_schedule_declines_what_it_cannot_run(rows, hidden, inter, sms, why):
    assert decode_mlp.schedule(rows, hidden, inter, sms) is None, why


def test_schedule_takes_the_same_geometry_at_fewer_rows():
    assert decode_mlp.schedule(8, 3072, 4096, 132) is not None  # the SMEM case above, at 8 rows


@pytest.mark.parametrize("rows, hidden, inter", [(2, 896, 4864), (32, 896, 4864), (5, 256, 512)])
def test_cross_lowers_for_cuda(rows, hidden, inter):
    plan = decode_mlp.schedule(rows, hidden, inter, 132)
    bf = jnp.bfloat16
    args = [jax.ShapeDtypeStruct(s, bf) for s in ((plan.rows, hidden), (inter, hidden), (inter, hidden),
                                                  (hidden, inter))]
    fn = jax.jit(functools.partial(decode_mlp.gated_mlp_sum, act="silu", plan=plan))
    # lowering runs Mosaic GPU's layout and transform checks (wgmma operands, swizzles, transposed loads and
    # stores, the reduce-add stores)
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_many_call_sites_behind_the_dispatch_jit_lower_the_kernel_once():
    """Every layer calls the kernel; behind ``lowered_once`` (as the dispatch point registers kernels) its Mosaic
    GPU module is built and embedded once, not once per call site."""
    plan = decode_mlp.schedule(8, 256, 512, 132)
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((8, 256), (512, 256), (512, 256), (256, 512))]
    kernel = lowered_once(functools.partial(decode_mlp.gated_mlp_sum, act="silu", plan=plan))

    def layers(n, h, w_gate, w_up, w_down):
        for _ in range(n):
            h = h + kernel(h, w_gate, w_up, w_down).T.astype(h.dtype)
        return h

    def lowered_text(n):
        fn = jax.jit(functools.partial(layers, n))
        return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    one, four = lowered_text(1), lowered_text(4)
    assert one.count("mosaic_gpu") == four.count("mosaic_gpu") > 0  # plain calls: four times as many


def _sum_in_jnp(h, w_gate, w_up, w_down, *, act, plan):
    """What the kernel computes, in jnp: the down projection of the normalised rows' MLP, float32 [hidden,
    rows8]."""
    assert h.shape == (plan.rows, plan.hidden)
    gate = (h @ w_gate.T).astype(h.dtype)
    product = activation(act, gate) * (h @ w_up.T).astype(h.dtype)
    return (product.astype(F32) @ w_down.T.astype(F32)).T


@pytest.mark.parametrize("rows", [2, 13, 32])
def test_entry_pads_rounds_and_adds_the_residual(rows, monkeypatch):
    monkeypatch.setattr(decode_mlp, "gated_mlp_sum", _sum_in_jnp)
    norm, gate, up, down = _mlp_weights(256, 512)
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 256)).astype(jnp.bfloat16)
    got = decode_mlp.gated_mlp_residual(x, norm, 1e-5, gate, up, down, "silu", sms=132)
    want = decode_fused.gated_mlp_residual(x, norm, 1e-5, gate, up, down, "silu")
    assert got.shape == want.shape and got.dtype == want.dtype
    # equal up to the sum's order: at most one bf16 rounding step apart
    diff = jnp.abs(got.astype(F32) - want.astype(F32))
    assert float(jnp.max(diff)) <= 2 ** -7 * float(jnp.max(jnp.abs(want.astype(F32))))


def test_entry_falls_back_below_its_rows_and_outside_its_shapes(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel must not run here")

    monkeypatch.setattr(decode_mlp, "gated_mlp_sum", no_kernel)
    norm, gate, up, down = _mlp_weights(256, 512)
    for rows in (decode_mlp.MIN_ROWS - 1, 13):
        x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 256)).astype(jnp.bfloat16)
        sms = 132 if rows < decode_mlp.MIN_ROWS else 4  # too few SMs for a schedule
        got = decode_mlp.gated_mlp_residual(x, norm, 1e-5, gate, up, down, "silu", sms=sms)
        # the dispatched two-op chain (the GEMV kernels on a GPU, the jnp chain elsewhere)
        product = dispatch.op("norm_gated_mlp")(x, norm, 1e-5, gate, up, "silu")
        assert jnp.array_equal(got, dispatch.op("matmul_add")(product, down, x))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="Mosaic GPU kernels run only on a GPU")
@pytest.mark.parametrize("rows", [2, 8, 13, 32])
def test_kernel_matches_the_chain_on_the_gpu(rows):
    norm, gate, up, down = _mlp_weights(896, 4864)
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 896)).astype(jnp.bfloat16)
    fn = jax.jit(functools.partial(decode_mlp.gated_mlp_residual, eps=1e-5, act="silu"))
    want = decode_fused.gated_mlp_residual(x, norm, 1e-5, gate, up, down, "silu")
    outs = [fn(x, norm, w_gate=gate, w_up=up, w_down=down) for _ in range(3)]  # the counters reset between calls
    for got in outs:  # one rounding of the down projection and one of the residual add apart at most (the
        # reduce-add stores' order varies between calls, so the calls need not be equal bit for bit)
        assert float(jnp.max(jnp.abs(got.astype(F32) - want.astype(F32)))) <= 2 ** -6 * float(
            jnp.max(jnp.abs(want.astype(F32))))


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="activation"):
        decode_mlp._activation("swish", jnp.zeros(()))
