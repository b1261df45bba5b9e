"""The trace reader behind the benchmarks' kernel GPU times (apriel2_jax.benchmarking.kernel_times)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.benchmarking import engine_table_pages, kernel_times, paged_decode_inputs, per_call_us


def _meta(pid, tid, process, thread):
    return [dict(ph="M", name="process_name", pid=pid, args=dict(name=process)),
            dict(ph="M", name="thread_name", pid=pid, tid=tid, args=dict(name=thread))]


def test_kernel_times_counts_gpu_stream_events_only():
    """A kernel's name also marks its host-side launch; only the device stream's events are kernel times."""
    events = _meta(1, 7, "/device:GPU:0", "Stream #7(Compute)") + _meta(2, 3, "/host:CPU", "Host Threads/1")
    events += [dict(ph="X", name="chunk_o", pid=1, tid=7, dur=d) for d in (94.0, 95.0, 96.0)]
    events += [dict(ph="X", name="chunk_o", pid=2, tid=3, dur=d) for d in (9.0, 10.0, 29.0)]
    events += [dict(ph="X", name="other", pid=1, tid=7, dur=5.0), dict(ph="i", name="chunk_o", pid=1, tid=7)]
    assert kernel_times({"traceEvents": events}, match="chunk") == {"chunk_o": (3, 95.0)}
    assert kernel_times(events) == {"chunk_o": (3, 95.0), "other": (1, 5.0)}
    assert kernel_times(events[4:]) == {}  # no track names: nothing is known to be a GPU kernel


def test_per_call_us_sums_every_kernel_over_the_calls():
    assert per_call_us({"a": (3, 95.0), "b": (6, 10.0)}, 3) == 95.0 + 20.0


def test_step_breakdown_splits_busy_and_idle_time_and_names_kinds():
    from apriel2_jax.benchmarking import device_intervals, kernel_kind, step_breakdown

    events = _meta(1, 7, "/device:GPU:0", "Stream #7(Compute)") + _meta(2, 3, "/host:CPU", "Host Threads/1")
    # Two steps: a matmul and an overlapping attention kernel, then an idle gap, then a copy.
    events += [dict(ph="X", name="gemm_fusion_dot_1", pid=1, tid=7, ts=0.0, dur=10.0),
               dict(ph="X", name="paged_attention_decode", pid=1, tid=7, ts=5.0, dur=10.0),
               dict(ph="X", name="MemcpyD2H", pid=1, tid=7, ts=35.0, dur=5.0),
               dict(ph="X", name="host_only", pid=2, tid=3, ts=0.0, dur=100.0)]
    intervals = device_intervals(events)
    assert [name for name, _, _ in intervals] == ["gemm_fusion_dot_1", "paged_attention_decode", "MemcpyD2H"]
    b = step_breakdown(intervals, steps=2)
    assert b["span_us"] == 20.0 and b["busy_us"] == 10.0 and b["idle_us"] == 10.0 and b["events"] == 1.5
    assert b["kinds_us"] == {"matmul": 5.0, "attention": 5.0, "copy/memset": 2.5}
    assert kernel_kind("input_reduce_fusion_3") == "sort/reduce" and kernel_kind("loop_add_fusion") == "fusion/other"
    assert step_breakdown([], 3) == {}


def test_device_intervals_reads_one_device_of_a_tensor_parallel_trace():
    """Every device of a mesh runs the same step: the first device's timeline is the step's, and NCCL's kernels
    count as collectives."""
    from apriel2_jax.benchmarking import device_intervals, kernel_kind, step_breakdown

    events = (_meta(1, 7, "/device:GPU:10", "Stream #7(Compute)") + _meta(2, 7, "/device:GPU:0", "Stream #7(Compute)")
              + _meta(3, 7, "/device:GPU:2", "Stream #7(Compute)") + _meta(4, 1, "/device:CPU:0", "Host"))
    events += [dict(ph="X", name="gemm_fusion_dot", pid=2, tid=7, ts=0.0, dur=4.0),
               dict(ph="X", name="ncclDevKernel_AllReduce_Sum_bf16_RING_LL", pid=2, tid=7, ts=6.0, dur=2.0),
               dict(ph="X", name="gemm_fusion_dot", pid=3, tid=7, ts=4.0, dur=2.0),
               dict(ph="X", name="late", pid=1, tid=7, ts=50.0, dur=1.0)]
    intervals = device_intervals(events)
    assert [name for name, _, _ in intervals] == ["gemm_fusion_dot", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"]
    b = step_breakdown(intervals, steps=1)
    assert b["span_us"] == 8.0 and b["idle_us"] == 2.0
    assert b["kinds_us"] == {"matmul": 4.0, "collective": 2.0}
    assert kernel_kind("all-reduce-start.3") == "collective" and kernel_kind("psum_884_0_fusion_1") == "collective"


def _traced_here(x, w):
    y = jnp.concatenate([x @ w, x @ w.T], axis=-1)  # the line the concatenation is traced from
    return jnp.tanh(y) * 2 + 1


def _optimized_hlo():
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    return jax.jit(_traced_here).lower(x, w).compile().as_text()


def test_hlo_sources_name_the_lines_a_kernel_was_traced_from():
    import inspect

    from apriel2_jax.benchmarking import hlo_sources

    text = _optimized_hlo()
    sources = hlo_sources(text)
    concat_line = inspect.getsourcelines(_traced_here)[1] + 1
    tanh_line = concat_line + 1
    # Every fused kernel of the module (XLA names them; the names differ by backend) gets a source line of this
    # file; the fusion holding the concatenation names its line and the tanh's.
    fusions = [re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line).group(1) for line in text.splitlines()
               if " fusion(" in line]
    assert fusions
    for name in fusions:
        assert "test_benchmarking.py:" in sources[name], (name, sources[name])
    named = " ".join(sources[n] for n in fusions)
    assert f"test_benchmarking.py:{concat_line}" in named and f"test_benchmarking.py:{tanh_line}" in named


def test_hlo_dump_sources_pick_the_module_that_names_the_traced_kernels(tmp_path):
    from apriel2_jax.benchmarking import hlo_dump_sources, hlo_sources

    text = _optimized_hlo()
    kernels = list(hlo_sources(text))
    (tmp_path / "module_0001.jit_other.cpu_after_optimizations.txt").write_text(
        "HloModule other\n\nENTRY %main (p: f32[2]) -> f32[2] {\n  ROOT %p = f32[2]{0} parameter(0)\n}\n")
    (tmp_path / "module_0002.jit__step_fn.cpu_after_optimizations.txt").write_text(text)
    (tmp_path / "module_0002.jit__step_fn.cpu_before_optimizations.txt").write_text("not read")
    found = hlo_dump_sources(str(tmp_path), kernels)
    assert {k: found[k] for k in kernels} == hlo_sources(text)
    assert hlo_dump_sources(str(tmp_path), ["no_such_kernel"]) == {}
    # A trace names a kernel by its instruction's name with '.' (and '-') as '_': fusion.384 runs as fusion_384.
    dotted = [name for name in kernels if "." in name]
    assert dotted
    by_kernel = hlo_dump_sources(str(tmp_path), [n.replace(".", "_") for n in dotted])
    for name in dotted:
        assert by_kernel[name.replace(".", "_")] == hlo_sources(text)[name]


def test_paged_decode_inputs_place_each_row_at_its_position():
    inputs, qkv, pools = paged_decode_inputs(rows=3, heads=4, groups=2, head_dim=8, context=37, page_size=8,
                                             width=6, pools=2)
    table = np.asarray(inputs["table"])
    assert table.shape == (3, 6) and qkv.shape == (3, 8, 8) and len(pools) == 2
    assert pools[0][0].shape == (3 * 6 + 1, 8, 2, 8)
    # pages up to the position's (37 // 8 = 4) are distinct real pages, the rest empty (the sink page 0)
    assert (table[:, :5] > 0).all() and (table[:, 5:] == 0).all() and len(set(table[:, :5].ravel())) == 15
    slots = np.asarray(inputs["slots"])
    assert (slots == table[:, 4] * 8 + 37 % 8).all()
    assert (np.asarray(inputs["positions"])[:, 0] == 37).all()
    with pytest.raises(ValueError, match="does not hold position 48"):
        paged_decode_inputs(rows=1, heads=4, groups=2, head_dim=8, context=48, page_size=8, width=6)


def test_engine_table_pages_hold_the_prompt_the_output_and_a_page():
    assert engine_table_pages(1024, 128, 16) == 73  # the 0.5B decode table's 73-page tables
    assert engine_table_pages(1000, 100, 16) == 70  # 1100 tokens end mid-page: 69 pages, and one more
