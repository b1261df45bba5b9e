"""scripts/profile_decode_kernels.py's inputs and call lists (the profiling itself needs a GPU)."""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import load_script


def test_attention_inputs_are_the_kernels_arguments_in_order():
    from pallas_kernels.paged_attention_decode import rope_write_paged_attention_decode

    script = load_script("profile_decode_kernels")
    inputs = script.attention_inputs(3, 4, 2, 16, 40, 8)
    out, k_pages, v_pages = jax.eval_shape(rope_write_paged_attention_decode, *inputs)
    assert out.shape == (3, 4, 16) and k_pages.shape == inputs[6].shape == v_pages.shape
    # the table bench_generate.py gives: the prompt's 40 tokens, 128 new ones and a page, in pages of 8
    assert inputs[8].shape == (3, -(-(40 + 128) // 8) + 1)


def test_gemv_calls_only_where_the_engine_runs_them():
    script = load_script("profile_decode_kernels")
    args = argparse.Namespace(hidden=64, intermediate=128, heads=4, groups=2, head_dim=16, context=40, page_size=8)
    rand = script.random_bf16(jax.random.PRNGKey(0))
    counts = {rows: len(script.calls_for("gemv", rows, args, rand)) for rows in (1, 2, 3)}
    assert counts == {1: 4, 2: 3, 3: 0}  # gate/up at one row, down, Q/K/V and the output projection at two
    # Weights past the engine's limit per call: gate and up (2 x 16 KB here) leave, the rest (<= 16 KB) stay.
    from pallas_kernels import decode_gemv

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_gemv, "KERNEL_MAX_WEIGHT_BYTES",
                      {op: dict.fromkeys(rows, 16 * 1024) for op, rows in decode_gemv.KERNEL_MAX_WEIGHT_BYTES.items()})
        assert len(script.calls_for("gemv", 1, args, rand)) == 3


def test_random_inputs_never_run_out_of_keys():
    script = load_script("profile_decode_kernels")
    rand = script.random_bf16(jax.random.PRNGKey(0))
    draws = [rand(4) for _ in range(100)]
    assert all(d.dtype == jnp.bfloat16 for d in draws)
    assert len({np.asarray(d, np.float32).tobytes() for d in draws}) == 100
