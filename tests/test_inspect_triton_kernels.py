"""scripts/inspect_triton_kernels.py: the decode Triton kernels lowered and compiled for sm_90 on the CPU."""

import pytest

from tests.helpers import load_script


def _script():
    return load_script("inspect_triton_kernels")


def test_the_output_projection_lowers_to_one_triton_kernel_with_its_launch():
    script = _script()
    fn, args = script.kernel_cases(1)["o_proj"]
    (kernel,) = script.triton_modules(fn, args)
    assert kernel["name"] == "gemv_add_k896"
    assert (kernel["num_warps"], kernel["num_stages"]) == (8, 1)
    assert "tt.func public @gemv_add_k896" in kernel["ttir"]


def test_keyword_options_reach_the_kernel():
    script = _script()
    fn, args = script.kernel_cases(32, options={"attention": {"splits": 2}})["attention"]
    names = [k["name"] for k in script.triton_modules(fn, args)]
    assert names == ["rope_write_paged_attention_decode_ps16_n128_s2"]  # 32 rows: XLA merges the splits


def test_compiled_for_sm90_with_registers_and_its_layout_conversions():
    pytest.importorskip("triton", reason="the triton package compiles the TTIR (installed with the test extra's torch)")
    script = _script()
    fn, args = script.kernel_cases(1)["down"]
    (kernel,) = script.triton_modules(fn, args)
    result = script.compile_sm90(kernel)
    summary = result["summary"]
    assert summary["kernel"] == "gemv_add_k4864"
    assert 0 < summary["registers"] <= 255
    # the activation row converted for each of the 19 input chunks, and the final reduction
    assert summary["layout_conversions"] >= 19
    assert summary["barriers"] >= summary["layout_conversions"]
    assert "ttg.convert_layout" in result["ttgir"] and ".target sm_90" in result["ptx"]


def test_a_malformed_option_is_refused_by_name():
    with pytest.raises(SystemExit, match="KERNEL:KEY=INTEGER"):
        _script().main(["--set", "gate_up:depth"])
