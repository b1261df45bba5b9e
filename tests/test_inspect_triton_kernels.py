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


def test_a_second_lowering_of_the_same_case_captures_its_kernel_again():
    script = _script()
    fn, args = script.kernel_cases(1)["o_proj"]
    first, second = script.triton_modules(fn, args), script.triton_modules(fn, args)
    assert [k["name"] for k in first] == [k["name"] for k in second] == ["gemv_add_k896"]


def test_keyword_options_reach_the_kernel():
    script = _script()
    fn, args = script.kernel_cases(32, options={"attention": {"splits": 2}})["attention"]
    names = [k["name"] for k in script.triton_modules(fn, args)]
    assert names == ["rope_write_paged_attention_decode_ps16_n128_s2"]  # 32 rows: XLA merges the splits


def test_compiled_for_sm90_with_registers_and_its_layout_conversions():
    pytest.importorskip("triton", reason="the triton package compiles the TTIR (the test extra pins it)")
    script = _script()
    cases = script.kernel_cases(1)
    down = script.compile_sm90(script.triton_modules(*cases["down"])[0])
    o_proj = script.compile_sm90(script.triton_modules(*cases["o_proj"])[0])
    assert down["summary"]["kernel"] == "gemv_add_k4864" and o_proj["summary"]["kernel"] == "gemv_add_k896"
    assert 0 < down["summary"]["registers"] <= 255 and 0 < o_proj["summary"]["registers"] <= 255
    # Triton 3.6 converts the down projection's activation row for each of its 19 input chunks (256 threads over a
    # [4, 256] tile), the output projection's only for its final reduction
    assert down["summary"]["layout_conversions"] >= 19
    assert o_proj["summary"]["layout_conversions"] == 1
    assert down["summary"]["barriers"] > 2 * o_proj["summary"]["barriers"]
    assert "ttg.convert_layout" in down["ttgir"] and ".target sm_90" in down["ptx"]


def test_a_malformed_option_is_refused_by_name():
    with pytest.raises(SystemExit, match="KERNEL:KEY=VALUE"):
        _script().main(["--set", "gate_up:depth"])
