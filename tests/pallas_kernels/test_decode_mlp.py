"""The persistent decode MLP kernel (``pallas_kernels/decode_mlp``): its schedule (plain Python) and its lowering
for CUDA. Mosaic GPU kernels with grid-wide semaphores have no CPU interpreter, so the numerics are checked on the
GPU (equal to the bf16 jnp chain for 1-32 rows, three geometries, silu and tanh-gelu; see the module docstring);
the engine's wiring of the whole-MLP op is checked in ``tests/modules/test_fused_decode.py``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import decode_mlp


def test_schedule_fills_an_h200_at_the_05b_geometry():
    plan = decode_mlp.schedule(1, 896, 4864, 132)
    assert plan.rows == 8
    assert (plan.gate_up_ctas, plan.out_tiles, plan.splits) == (76, 14, 4)
    assert plan.programs == 132
    # every split gets a K range, and they cover the intermediate width
    ranges = [(s * plan.k_blocks // plan.splits, (s + 1) * plan.k_blocks // plan.splits) for s in range(plan.splits)]
    assert ranges[0][0] == 0 and ranges[-1][1] == plan.k_blocks
    assert all(lo < hi <= lo + plan.max_down_blocks for lo, hi in ranges)


@pytest.mark.parametrize("rows", [1, 8, 13, 32])
def test_schedule_stays_within_shared_memory(rows):
    plan = decode_mlp.schedule(rows, 896, 4864, 132)
    block = decode_mlp.TILE * decode_mlp.BLOCK_K * 2
    gate_up = plan.rows * plan.hidden * 2 + 2 * plan.gate_up_depth * block + plan.rows * decode_mlp.TILE * 2
    down = plan.down_depth * block + plan.max_down_blocks * plan.rows * decode_mlp.BLOCK_K * 2 + plan.rows * 64 * 4
    assert max(gate_up, down) <= decode_mlp.SMEM_BYTES
    assert plan.gate_up_depth >= 1 and plan.down_depth >= 1
    assert plan.rows == -(-rows // 8) * 8


@pytest.mark.parametrize("rows, hidden, inter, sms, why", [
    (33, 896, 4864, 132, "more rows than the kernel takes"),
    (1, 5120, 14336, 132, "15B: 224 gate/up tiles on 132 SMs"),
    (1, 896, 4864, 80, "too few SMs for a CTA per tile"),
    (1, 960, 4864, 132, "hidden width not a multiple of 128"),
])
def test_schedule_declines_what_it_cannot_run(rows, hidden, inter, sms, why):
    assert decode_mlp.schedule(rows, hidden, inter, sms) is None, why


@pytest.mark.parametrize("rows, hidden, inter", [(1, 896, 4864), (32, 896, 4864), (5, 256, 512)])
def test_cross_lowers_for_cuda(rows, hidden, inter):
    plan = decode_mlp.schedule(rows, hidden, inter, 132)
    bf = jnp.bfloat16
    args = [jax.ShapeDtypeStruct(s, bf) for s in ((plan.rows, hidden), (inter, hidden), (inter, hidden),
                                                  (hidden, inter))]
    fn = jax.jit(functools.partial(decode_mlp.gated_mlp_partials, act="silu", plan=plan))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    out = jax.eval_shape(fn, *args)
    assert out.shape == (plan.splits, hidden, plan.rows) and out.dtype == jnp.float32


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="activation"):
        decode_mlp._activation("swish", jnp.zeros(()))
