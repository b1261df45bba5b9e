#!/usr/bin/env python3
"""Generation benchmark on random weights of a real Apriel2 geometry.

    python scripts/bench_generate.py ../shared/configs/apriel2-0.5b-shaped --placement a12-g1-k11 \
        --batch 8 --prompt-len 4096 --output-len 64

The supernet is pruned to the placement's active mixers (a serving deployment of one placement moves the same
bytes; inactive sub-mixers only cost memory). Measures, side by side in one process:
  * HBM bandwidth (a large device copy) and the decode roofline: the bytes one decode step must move at least
    (the weights once except the input embedding table, which a step gathers one row of per sequence; K/V of the
    context per attention layer, recurrent state read + write) over that
    bandwidth, versus the measured step time;
  * prefill throughput over ``--prefill-batch`` prompts of ``--prompt-len`` tokens (chunked, as served), with
    the fraction of bf16 tensor-core peak its matmul FLOPs reach (2 x the decoder layers' weights per token:
    logits are computed for each row's last token only; attention's score FLOPs are not counted);
  * decode throughput of ``--batch`` sequences at context ``--prompt-len``, on caches admitted as prefilled
    (pages and slots allocated, contents not computed: timing does not depend on the values).
  * ``--capacity``: instead, as many requests of ``--prompt-len`` tokens as the cache holds (admitted as
    prefilled) decode ``--output-len`` tokens each; reports the request count and output tokens/s (wall clock),
    and each placement's ratio to the first placement given (put all-attention first).
  * ``--shared-prefix N``: instead, prefix caching. ``--requests`` prompts share an N-token prefix, each
    followed by ``--suffix-len`` unique tokens, submitted together and generating one token, with the engine's
    serving defaults; run with and without prefix caching (same compiled steps). Reports the total prefill
    time, tokens computed, time to first token and the hit rate of each cache family, and the speed-up.
  * ``--kv-prefix N``: instead, the external KV connector: time to first token of a prompt whose N-token
    prefix a fresh engine (empty device caches) recomputes, loads from a host-memory store, or loads from a
    disk store (``--kv-path``; read through the OS page cache when it holds the files), each followed by
    ``--suffix-len`` new tokens; and the same prompt prefix once more, now a local prefix-cache hit. Each
    engine first serves another prefix the same way, so every path is compiled before it is timed.
  * ``--dispatch-cost``: instead, a decode dispatch's fixed cost: the step of ``--batch`` rows dispatched 20
    times back to back at 1, ``--decode-steps`` and twice that many steps per dispatch (ms per dispatch, and the
    host time of the call for one step), and the host time of launching a trivial jitted call by its number
    of array arguments and donated arrays.
  * ``--sampler``: instead, the decode sampler (``engine.sampling.sample``, no top-k/top-p) on ``--batch``
    rows of random logits at the geometry's vocabulary, half the rows greedy, against the same sampler drawing
    with ``jax.random.categorical`` (threefry noise per vocabulary entry): kernel time per call from a
    ``jax.profiler`` trace, and the logits' bytes (bf16, read once) over the bandwidth. No placement needed.
Prints one table row per placement and batch; ``--json`` appends the rows to a JSONL file.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from apriel2_jax.benchmarking import (append_jsonl, device_intervals, hbm_bandwidth, hlo_dump_sources,  # noqa: E402
                                      print_breakdown, print_rows, step_breakdown, trace_events)
from apriel2_jax import dispatch  # noqa: E402
from apriel2_jax.config import parse_config  # noqa: E402
from apriel2_jax.engine.cache_layout import CacheConfigError, cache_layout, plan_cache  # noqa: E402
from apriel2_jax.engine.llm import LLM  # noqa: E402
from apriel2_jax.engine import sampling  # noqa: E402
from apriel2_jax.engine.sampling import SamplingParams, make_keys  # noqa: E402
from apriel2_jax.engine.defaults import DEFAULTS  # noqa: E402
from apriel2_jax.engine.step import Buckets, build_inputs, unpack_outputs  # noqa: E402
from apriel2_jax.modules import Apriel2ForCausalLM  # noqa: E402
from apriel2_jax.placement import load_placements, resolve_placement  # noqa: E402
from apriel2_jax.tensor_parallel import random_sharded  # noqa: E402
from convert.thinning import thin  # noqa: E402

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peak (SXM)


def weight_counts(config, params: int) -> tuple[int, int]:
    """(weights a decode step reads, weights a prefill token multiplies). A decode step reads every weight except
    the input embedding table, of which it gathers one row per sequence (unless tied: then the table is also the
    LM head, read whole). A prefill token multiplies through the decoder layers only: logits are computed for
    each row's last token, so neither the table nor the LM head counts per token."""
    table = config.vocab_size * config.hidden_size
    tied = config.tie_word_embeddings
    return params - (0 if tied else table), params - (1 if tied else 2) * table


def decode_bytes(layout, batch: int, context: int, dtype_bytes: int, weights: int, hidden: int) -> int:
    """The least a decode step must move: the weights it reads once, each sequence's embedding row and visible K/V,
    states read + written."""
    total = (weights + batch * hidden) * dtype_bytes
    for fam in layout.attention:
        visible = context if fam.window is None else min(context, fam.window)
        total += batch * visible * fam.token_bytes
    if layout.state:
        total += 2 * batch * layout.state.slot_bytes
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config_dir")
    ap.add_argument("--placement", nargs="+", default=[], help="one or more placement names (one row each)")
    ap.add_argument("--batch", type=int, nargs="+", default=[8], help="decode batch sizes (one row each)")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefill-batch", type=int, default=1)
    ap.add_argument("--max-chunk", type=int, default=512)
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="prefill token budget (default: max chunk)")
    ap.add_argument("--max-prefill-rows", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engine's max_model_len (default: prompt + output + one page, the least that serves them; "
                    "a served model's is usually its max_position_embeddings)")
    ap.add_argument("--no-chain-decode", dest="chain_decode", action="store_false",
                    help="read every decode dispatch before queueing the next (the engine's chaining off)")
    ap.add_argument("--no-chain-prefill", dest="chain_prefill", action="store_false",
                    help="read every prefill step before queueing the next (the engine's prefill chaining off)")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="decode tokens per dispatch (default: the engine's)")
    ap.add_argument("--defaults", action="store_true",
                    help="prefill with the engine's default token budget, chunk and rows (ignores the three flags)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--warm-up", choices=("few", "all", "none"), default=None,
                    help="the engine's start-up compilation in the decode/prefill runs (default: LLM's); none "
                    "compiles the measured shapes on their first, untimed run")
    ap.add_argument("--capacity", action="store_true",
                    help="decode as many requests as the cache holds (see above) instead of --batch")
    ap.add_argument("--shared-prefix", type=int, default=None, metavar="N",
                    help="benchmark prefix caching on prompts sharing an N-token prefix (see above)")
    ap.add_argument("--requests", type=int, default=64, help="--shared-prefix: prompts submitted together")
    ap.add_argument("--suffix-len", type=int, default=256, help="--shared-prefix: unique tokens after the prefix")
    ap.add_argument("--snapshot-interval", type=int, default=0, help="--shared-prefix: the engine's snapshot_interval")
    ap.add_argument("--kv-prefix", type=int, default=None, metavar="N",
                    help="benchmark loading an N-token prefix through the KV connector (see above)")
    ap.add_argument("--kv-path", default=None, help="--kv-prefix: directory of the disk store (default: a temp dir)")
    ap.add_argument("--trace", action="store_true",
                    help="profile decode and prefill steps (jax.profiler) and print where the device time goes")
    ap.add_argument("--trace-dir", default=None,
                    help="--trace: keep the profiler traces under this directory (one per traced workload)")
    ap.add_argument("--hlo-dir", default=None,
                    help="--trace: dump the engine step's optimized HLO under this directory (through XLA_FLAGS) and "
                    "print the source lines each top kernel comes from")
    ap.add_argument("--tensor-parallel", nargs="+", default=["none"], metavar="N|none",
                    help="one row set per entry: 'none' (default) runs the one-device model, N splits it over N "
                    "devices through the tensor-parallel path (1: that path on one device, to measure its cost)")
    ap.add_argument("--unfused-decode-attention", action="store_true",
                    help="decode attention as the chain of dispatched ops (RoPE, page writes, the paged attention "
                    "kernel) instead of the fused kernel: the side-by-side baseline of that kernel")
    ap.add_argument("--xla-decode-projections", action="store_true",
                    help="decode projections as XLA's fusions (norms, matmuls, activation product and residual adds "
                    "apart) instead of the fused GEMV kernels of pallas_kernels/decode_gemv: their side-by-side "
                    "baseline")
    ap.add_argument("--decode-mlp-kernel", action="store_true",
                    help="decode MLPs of 2-32 rows as the persistent MLP kernel of pallas_kernels/decode_mlp (not "
                    "registered by default) instead of XLA's GEMMs; one row and tensor-parallel rows keep the other "
                    "path")
    ap.add_argument("--dispatch-cost", action="store_true",
                    help="measure a decode dispatch's fixed cost instead (see the module docstring)")
    ap.add_argument("--sampler", action="store_true",
                    help="time the decode sampler against jax.random.categorical instead (see the module docstring)")
    ap.add_argument("--json", default=None, help="append the result rows to this JSONL file")
    args = ap.parse_args(argv)
    if not args.placement and not args.sampler:
        ap.error("--placement is required (one or more placement names of the config)")
    if args.hlo_dir:
        if not args.trace:
            ap.error("--hlo-dir names the kernels of --trace's breakdown: pass --trace too")
        # XLA reads its flags when the first backend starts, which has not happened yet.
        os.makedirs(args.hlo_dir, exist_ok=True)
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={args.hlo_dir} "
                                   "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=_step_fn").strip()
    if args.unfused_decode_attention:
        dispatch.unregister("rope_write_paged_attention")
    if args.decode_mlp_kernel and args.xla_decode_projections:
        ap.error("--decode-mlp-kernel and --xla-decode-projections exclude each other (the latter is the XLA baseline)")
    if args.decode_mlp_kernel:
        from pallas_kernels import decode_mlp

        dispatch.register("gated_mlp_residual", "gpu", decode_mlp.gated_mlp_residual)
    if args.xla_decode_projections:
        for name in ("norm_projections", "norm_gated_mlp", "matmul_add"):
            dispatch.unregister(name)
    args.tensor_parallel = [None if tp == "none" else int(tp) for tp in args.tensor_parallel]

    with open(os.path.join(args.config_dir, "config.json")) as f:
        raw = json.load(f)
    supernet = parse_config(raw)
    named = load_placements(args.config_dir)
    bandwidth = hbm_bandwidth()
    rows = sampler_rows(raw, args.batch, bandwidth) if args.sampler else []
    try:
        for tp in args.tensor_parallel if not args.sampler else ():
            for name in args.placement:
                run = (run_capacity if args.capacity else run_shared_prefix if args.shared_prefix
                       else run_kv_prefix if args.kv_prefix else run_dispatch_cost if args.dispatch_cost
                       else run_placement)
                rows += run(args, raw, resolve_placement(supernet, name, named), name, bandwidth, tp)
        if args.dispatch_cost:
            rows += launch_cost_rows()
    except BaseException as err:
        print(f"stopped after {len(rows)} rows (printed below): {type(err).__name__}: {err}", file=sys.stderr)
        raise
    finally:  # a run that fails (out of memory, too few devices) keeps the rows measured before it
        if args.capacity:
            for row in rows:
                row["vs_first"] = round(row["output_tok_s"] / rows[0]["output_tok_s"], 2)
        print_rows(rows)
        if args.json:
            append_jsonl(args.json, rows)
    return 0


def kernel_sources(args, breakdown: dict) -> dict[str, str] | None:
    """``--hlo-dir``: where the breakdown's top kernels come from, from the dumped step modules."""
    return hlo_dump_sources(args.hlo_dir, breakdown.get("top_us", {})) if args.hlo_dir else None


def trace_path(args, what: str) -> str | None:
    """Where ``--trace-dir`` keeps the trace of ``what`` (None: a temporary directory, removed)."""
    return os.path.join(args.trace_dir, what) if args.trace_dir else None


def random_model(args, raw: dict, placement, name: str, tp: int | None = None):
    """(config, model, parameter count, dtype) of random weights of the placement's pruned supernet; split over
    ``tp`` devices (created on them at their per-device shapes) unless ``tp`` is None."""
    # A serving deployment of one placement: the supernet thinned to its mixers (apriel2-convert --placement).
    keep = [None if name is None else {name} for name in placement]
    config = parse_config(thin(raw, parse_config(raw), keep)[0])
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    t0 = time.monotonic()
    abstract = nnx.eval_shape(lambda: Apriel2ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    if tp is None:
        model = Apriel2ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0))
    else:
        model = random_sharded(config, tp, dtype=dtype)
    print(f"{jax.devices()[0].device_kind}: random {params / 1e9:.2f}B-parameter model ({name}, tensor parallel "
          f"{tp or 'none'}) in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    return config, model, params, dtype


def run_placement(args, raw: dict, placement, name: str, bandwidth: float, tp: int | None = None) -> list[dict]:
    config, model, params, dtype = random_model(args, raw, placement, name, tp)
    devices = tp or 1
    dtype_bytes = np.dtype(dtype).itemsize
    device = jax.devices()[0]

    max_len = args.max_model_len or args.prompt_len + args.output_len + args.page_size
    batches = sorted(set(args.batch))
    engine = {} if args.defaults else dict(
        max_num_batched_tokens=args.max_batched_tokens or args.max_chunk,
        max_chunk=args.max_chunk,
        max_prefill_rows=args.max_prefill_rows,
        buckets=Buckets(tuple(batches), (args.max_prefill_rows,), (args.max_chunk,)),
    )
    if args.decode_steps:
        engine["decode_steps"] = args.decode_steps
    engine["chain_decode"] = args.chain_decode
    engine["chain_prefill"] = args.chain_prefill
    if args.warm_up:
        engine["warm_up"] = args.warm_up
    t0 = time.monotonic()
    llm = LLM(
        model=model,
        max_num_seqs=max(batches[-1], args.prefill_batch),
        max_model_len=max_len,
        page_size=args.page_size,
        cache_memory_fraction=0.9,
        **engine,
    )
    start_up = time.monotonic() - t0
    rng = np.random.default_rng(0)
    prompt = lambda: [int(t) for t in rng.integers(3, config.vocab_size, size=args.prompt_len)]  # noqa: E731

    # Prefill: the real chunked path; the first run compiles the step shapes it needs, the second is timed.
    prefill_prompts = [prompt() for _ in range(args.prefill_batch)]
    t0 = time.monotonic()
    llm.generate(prefill_prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))
    first_run = time.monotonic() - t0
    llm.reset_stats()
    prefill_prompts = [prompt() for _ in range(args.prefill_batch)]  # new tokens: no prefix-cache hits
    t0 = time.monotonic()
    llm.generate(prefill_prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))
    prefill_wall = time.monotonic() - t0
    prefill_tps = llm.stats.prefill_tokens_per_second
    prefill_wall_tps = llm.stats.prefill_tokens / prefill_wall
    prefill_chained = f"{llm.stats.chained_prefills}/{llm.stats.steps}"
    kind = next((k for k in PEAK_BF16_FLOPS if k in device.device_kind), None)
    decode_weights, prefill_weights = weight_counts(config, params)
    mfu = (2 * prefill_weights * prefill_tps / (devices * PEAK_BF16_FLOPS[kind])) if kind else float("nan")
    if args.trace:
        # The timed workload again on fresh prompts (the same ones would hit the prefix cache).
        traced = [prompt() for _ in range(args.prefill_batch)]
        before = llm.stats.steps
        events = trace_events(lambda: llm.generate(traced, SamplingParams(max_new_tokens=1, ignore_eos=True)), 1,
                              trace_path(args, f"prefill_{name}"))
        breakdown = step_breakdown(device_intervals(events), llm.stats.steps - before)
        print_breakdown(f"prefill {name} ({args.prefill_batch} x {args.prompt_len}, "
                        f"budget {llm.scheduler_config.max_num_batched_tokens} tokens)",
                        breakdown, kernel_sources(args, breakdown))
    rows = []
    for batch in batches:
        # Decode at context prompt_len on caches admitted as prefilled.
        params_d = SamplingParams(max_new_tokens=args.output_len, ignore_eos=True)
        prompts = [prompt() for _ in range(batch)]  # made outside the timed region
        decode = lambda: [None for _ in llm.stream(prompts, params_d, assume_prefilled=True)]  # noqa: E731
        decode()  # warm (first run of this bucket after compilation)
        llm.reset_stats()
        t0 = time.monotonic()
        decode()
        wall = time.monotonic() - t0
        stats = dataclasses.replace(llm.stats)  # before tracing adds to it
        step_s = stats.decode_seconds / max(stats.decode_steps, 1)
        wall_step_s = wall / max(stats.decode_steps, 1)
        device_step_us = float("nan")
        if args.trace:
            before = llm.stats.decode_steps
            events = trace_events(decode, 1, trace_path(args, f"decode_{name}_B{batch}"))
            breakdown = step_breakdown(device_intervals(events), llm.stats.decode_steps - before)
            print_breakdown(f"decode {name} B={batch} context {args.prompt_len}", breakdown,
                            kernel_sources(args, breakdown))
            device_step_us = breakdown.get("span_us", float("nan"))
        # The step's least bytes over every device's bandwidth (replicated KV heads or padding not counted).
        ideal = decode_bytes(cache_layout(config, llm.placement, dtype_bytes), batch, args.prompt_len, dtype_bytes,
                             decode_weights, config.hidden_size)
        roofline_s = ideal / (bandwidth * devices)
        rows.append({
            "device": device.device_kind,
            "date": time.strftime("%Y-%m-%d"),
            "config": os.path.basename(os.path.normpath(args.config_dir)),
            "placement": name,
            "tp": tp or "none",
            "params_B": round(params / 1e9, 3),
            "batch": batch,
            "context": args.prompt_len,
            "prefill_tok_s": round(prefill_tps, 1),
            "prefill_wall_tok_s": round(prefill_wall_tps, 1),
            "prefill_chained": prefill_chained,
            "prefill_mfu": round(mfu, 4),
            "decode_tok_s": round(stats.decode_tokens_per_second, 1),
            "decode_wall_tok_s": round(stats.decode_tokens / wall, 1),
            "step_ms": round(step_s * 1e3, 3),
            "wall_step_ms": round(wall_step_s * 1e3, 3),
            "device_step_ms": round(device_step_us / 1e3, 3),
            "roofline_ms": round(roofline_s * 1e3, 3),
            "roofline_ratio": round(roofline_s / step_s, 4),
            "hbm_GBps": round(bandwidth / 1e9, 1),
            "decode_steps": llm.decode_steps,
            "chained": f"{stats.chained_dispatches}/{stats.decode_dispatches}",
            "start_up_s": round(start_up, 1),
            "first_prefill_s": round(first_run, 1),
            "compilations": llm.runner.compilations,
        })
    del llm, model
    gc.collect()  # the next placement's cache budget is what is free now
    return rows


def run_dispatch_cost(args, raw: dict, placement, name: str, bandwidth: float, tp: int | None = None) -> list[dict]:
    """Per batch: decode dispatches of 1, ``decode_steps`` and twice that many steps, the same inputs each time,
    with the host waiting for each one's results (as the engine does)."""
    config, model, params, dtype = random_model(args, raw, placement, name, tp)
    batches = sorted(set(args.batch))
    steps = args.decode_steps or DEFAULTS.decode_steps
    # Scheduled with budgets of 2 x steps, so every dispatch below writes only pages its rows hold.
    llm = LLM(model=model, max_num_seqs=batches[-1], max_model_len=args.prompt_len + 4 * steps, decode_steps=2 * steps,
              page_size=args.page_size, cache_memory_fraction=0.9, warm_up="none")
    rng = np.random.default_rng(0)
    rows, calls = [], 20
    for batch in batches:
        prompts = [[int(t) for t in rng.integers(3, config.vocab_size, size=args.prompt_len)] for _ in range(batch)]
        requests = llm._make_requests(prompts, SamplingParams(max_new_tokens=2 * steps, ignore_eos=True))
        for request in requests:
            llm.scheduler.admit_cached(request, request.num_tokens - 1)
        step = llm.scheduler.schedule()
        shape = llm.buckets.pick("decode", len(step.rows), 1)
        for n in (1, steps, 2 * steps):
            inputs = build_inputs(step, shape, llm.cache_manager, [n] * len(step.rows))
            for _ in range(2):  # compile, then one more run
                out, llm._cache = llm.runner.run(llm._cache, inputs, llm.placement, n)
                unpack_outputs(out)
            launch = total = 0.0
            for _ in range(calls):
                t0 = time.perf_counter()
                out, llm._cache = llm.runner.run(llm._cache, inputs, llm.placement, n)
                t1 = time.perf_counter()
                unpack_outputs(out)
                launch, total = launch + t1 - t0, total + time.perf_counter() - t0
            rows.append({"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
                         "placement": name, "batch": batch, "context": args.prompt_len, "steps_per_dispatch": n,
                         "dispatch_ms": round(total / calls * 1e3, 3), "step_ms": round(total / calls / n * 1e3, 3),
                         "call_returns_ms": round(launch / calls * 1e3, 3)})
        for request in requests:
            llm.scheduler.abort(request.request_id)
    del llm, model
    gc.collect()
    return rows


def launch_cost_rows(calls: int = 200) -> list[dict]:
    """Host time of launching a trivial jitted call with ``arrays`` small array arguments, ``donated`` of them
    donated and returned (as a step's caches are)."""
    rows = []
    for arrays, donated in ((10, 0), (220, 0), (440, 0), (10, 48), (220, 48)):
        kept = [jnp.full((1024,), i, jnp.bfloat16) for i in range(arrays)]
        cache = [jnp.zeros((4096,), jnp.bfloat16) for _ in range(donated)]

        def call(kept, cache, ints):
            total = sum(a[:8].astype(jnp.float32).sum() for a in kept[:4]) + ints.sum()
            return total, [c.at[0].set(total.astype(c.dtype)) for c in cache]

        fn = jax.jit(call, donate_argnums=(1,))
        ints = np.zeros((1, 64), np.int32)
        for _ in range(3):
            out, cache = fn(kept, cache, ints)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(calls):
            out, cache = fn(kept, cache, ints)
        rows.append({"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"), "arrays": arrays,
                     "donated": donated, "launch_us": round((time.perf_counter() - t0) / calls * 1e6, 1)})
        jax.block_until_ready(out)
    return rows


def _categorical_draw(keys, scaled):
    """The baseline's draw: ``jax.random.categorical``, threefry noise per vocabulary entry."""
    return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)


def sampler_rows(raw: dict, batches: list[int], bandwidth: float, calls: int = 20) -> list[dict]:
    vocab = parse_config(raw).vocab_size
    rows = []
    for batch in sorted(set(batches)):
        logits = jax.random.normal(jax.random.key(0), (batch, vocab), jnp.bfloat16)
        temperature = jnp.where(jnp.arange(batch) % 2 == 0, 0.0, 0.8).astype(jnp.float32)
        keys = make_keys(list(range(batch)), [3] * batch)
        kernel_us, tokens = {}, {}
        for label, draw in (("ours", sampling._gumbel_sample), ("categorical", _categorical_draw)):
            # The same sampler with only its draw swapped: traced (and every call made) while patched in.
            with mock.patch.object(sampling, "_gumbel_sample", draw):
                fn = jax.jit(lambda x, t, k: sampling.sample(x.astype(jnp.float32), t, jnp.zeros(t.shape, jnp.int32),
                                                             jnp.ones(t.shape, jnp.float32), k, filters=False))
                tokens[label] = np.asarray(jax.block_until_ready(fn(logits, temperature, keys))[0])
                events = device_intervals(trace_events(lambda: jax.block_until_ready(fn(logits, temperature, keys)),
                                                       calls))
            kernel_us[label] = sum(e[2] for e in events) / calls
        floor_us = batch * vocab * 2 / bandwidth * 1e6
        timed = kernel_us["ours"] > 0  # no device kernels in the trace on CPU
        rows.append({"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"), "rows": batch,
                     "vocab": vocab, "sampler_us": round(kernel_us["ours"], 1),
                     "categorical_us": round(kernel_us["categorical"], 1),
                     "speedup": round(kernel_us["categorical"] / kernel_us["ours"], 2) if timed else None,
                     "bytes_floor_us": round(floor_us, 2), "pct_of_floor": round(100 * floor_us / kernel_us["ours"], 1) if timed else None,
                     "greedy_rows_same": bool((tokens["ours"][::2] == tokens["categorical"][::2]).all())})
    return rows


def cache_capacity(layout, budget: int, page_size: int, max_len: int, limit: int = 4096) -> int:
    """The most sequences of ``max_len`` tokens the cache holds at once (states, windows and full-attention
    pages all counted), by bisection over max_num_seqs."""
    def fits(n: int) -> bool:
        try:
            plan = plan_cache(layout, budget_bytes=budget, page_size=page_size, max_num_seqs=n,
                              max_model_len=max_len, max_chunk=512)
        except CacheConfigError:
            return False
        per_request = -(-max_len // page_size)
        return all((plan.pages[f.key] - 1) >= n * per_request for f in layout.attention if f.window is None)

    low, high = 0, 1
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def run_capacity(args, raw: dict, placement, name: str, bandwidth: float, tp: int | None = None) -> list[dict]:
    config, model, params, dtype = random_model(args, raw, placement, name, tp)
    device = jax.devices()[0]
    max_len = args.prompt_len + args.output_len + args.page_size
    stats = device.memory_stats() or {}
    budget = int(stats.get("bytes_limit", 0) * 0.9) - int(stats.get("bytes_in_use", 0)) if stats else 2**28
    per_device = model.local_config if tp else config  # a tensor-parallel device holds its share of each page
    layout = cache_layout(per_device, placement, np.dtype(dtype).itemsize)
    count = cache_capacity(layout, budget, args.page_size, max_len)
    print(f"{device.device_kind}: {name}: the cache holds {count} requests of {max_len} tokens", file=sys.stderr)
    extra = {"decode_steps": args.decode_steps} if args.decode_steps else {}
    llm = LLM(model=model, max_num_seqs=count, max_model_len=max_len, page_size=args.page_size, cache_bytes=budget,
              buckets=Buckets((count,), (1,), (512,)), max_num_batched_tokens=512, **extra)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, config.vocab_size, size=args.prompt_len)] for _ in range(count)]
    params_d = SamplingParams(max_new_tokens=args.output_len, ignore_eos=True)
    t0 = time.monotonic()
    outputs = [e for e in llm.stream(prompts, params_d, assume_prefilled=True) if e.finished]
    wall = time.monotonic() - t0
    tokens = sum(len(e.output.token_ids) for e in outputs)
    rows = [{
        "device": device.device_kind, "date": time.strftime("%Y-%m-%d"),
        "config": os.path.basename(os.path.normpath(args.config_dir)), "placement": name, "tp": tp or "none",
        "params_B": round(params / 1e9, 3), "context": args.prompt_len, "new_tokens": args.output_len,
        "requests": count, "output_tok_s": round(tokens / wall, 1),
        "step_ms": round(llm.stats.decode_seconds / max(llm.stats.decode_steps, 1) * 1e3, 3),
        "preemptions": llm.stats.preemptions,
    }]
    del llm, model
    gc.collect()
    return rows


def run_shared_prefix(args, raw: dict, placement, name: str, bandwidth: float, tp: int | None = None) -> list[dict]:
    config, model, params, dtype = random_model(args, raw, placement, name, tp)
    device = jax.devices()[0]
    max_len = args.shared_prefix + args.suffix_len + args.page_size
    rng = np.random.default_rng(0)
    tokens = lambda n: [int(t) for t in rng.integers(3, config.vocab_size, size=n)]  # noqa: E731

    def workload():
        prefix = tokens(args.shared_prefix)
        return [prefix + tokens(args.suffix_len) for _ in range(args.requests)]

    one_token = SamplingParams(max_new_tokens=1, ignore_eos=True)
    rows, runner = [], None
    for caching in (False, True):
        llm = LLM(model=model, max_model_len=max_len, page_size=args.page_size, cache_memory_fraction=0.9,
                  enable_prefix_caching=caching, snapshot_interval=args.snapshot_interval, step_runner=runner)
        runner = llm.runner  # the second engine reuses the compiled steps
        llm.generate(workload(), one_token)  # compiles the shapes this workload needs (another prefix)
        llm.reset_stats()
        prompts = workload()
        t0 = time.monotonic()
        outputs = llm.generate(prompts, one_token)
        wall = time.monotonic() - t0
        ttft = np.array([o.time_to_first_token for o in outputs]) * 1e3
        stats = llm.stats
        row = {
            "device": device.device_kind, "date": time.strftime("%Y-%m-%d"),
            "config": os.path.basename(os.path.normpath(args.config_dir)), "placement": name, "tp": tp or "none",
            "prefix_caching": "on" if caching else "off", "requests": args.requests,
            "prefix": args.shared_prefix, "suffix": args.suffix_len,
            "prefill_s": round(wall, 3), "prefill_tokens": stats.prefill_tokens,
            "prompt_tok_s": round(sum(len(p) for p in prompts) / wall, 1),
            "computed_tok_s": round(stats.prefill_tokens / wall, 1),
            "ttft_mean_ms": round(float(ttft.mean()), 1), "ttft_p50_ms": round(float(np.median(ttft)), 1),
            "ttft_max_ms": round(float(ttft.max()), 1), "steps": stats.steps,
            "hit_rate": round(stats.prefix.hit_rate(), 4),
        }
        for family in llm.layout.families:
            row[f"hit_{family}"] = round(stats.prefix.hit_rate(family), 4) if caching else 0.0
        row["speedup"] = round(rows[0]["prefill_s"] / wall, 2) if rows else 1.0
        rows.append(row)
        del llm
        gc.collect()
    del model
    gc.collect()
    return rows


def run_kv_prefix(args, raw: dict, placement, name: str, bandwidth: float, tp: int | None = None) -> list[dict]:
    import shutil
    import tempfile

    from apriel2_jax.engine.kv_connector import DiskStore, HostMemoryStore

    config, model, params, dtype = random_model(args, raw, placement, name, tp)
    device = jax.devices()[0]
    n = args.kv_prefix
    if n % args.page_size:
        raise SystemExit(f"--kv-prefix must be a multiple of --page-size {args.page_size}, got {n}")
    max_len = n + args.suffix_len + args.page_size
    rng = np.random.default_rng(0)
    tokens = lambda k: [int(t) for t in rng.integers(3, config.vocab_size, size=k)]  # noqa: E731
    warm_prefix, timed_prefix = tokens(n), tokens(n)
    one_token = SamplingParams.greedy(max_new_tokens=1, ignore_eos=True)
    # Chunks end at multiples of the prefix length, so the writer leaves a state entry exactly at N.
    engine = dict(model=model, max_model_len=max_len, page_size=args.page_size, cache_memory_fraction=0.9,
                  snapshot_interval=n, max_num_seqs=8)
    disk_dir = args.kv_path or tempfile.mkdtemp(prefix="apriel2-kv-")
    stores = {"host": HostMemoryStore(64 * 2**30), "disk": DiskStore(disk_dir)}
    runner = None

    def ttft(llm, prefix, suffix=None) -> float:
        out = llm.generate([prefix + (suffix or tokens(args.suffix_len))], one_token)[0]
        first_tokens.append(out.token_ids[0])
        return out.time_to_first_token

    first_tokens: list[int] = []
    timed_suffix = tokens(args.suffix_len)  # the same prompt in every mode: its greedy first token must agree

    writer = LLM(kv_connector=stores["host"], **engine)
    runner = writer.runner
    for prefix in (warm_prefix, timed_prefix):
        ttft(writer, prefix)
    writer.kv_connector.flush()
    for entry in list(stores["host"]._entries.values()):  # the same entries on disk
        stores["disk"].put(entry)
    del writer
    gc.collect()
    rows = []
    for mode in ("recompute", "host", "disk"):
        llm = LLM(kv_connector=stores.get(mode), step_runner=runner, **engine)
        ttft(llm, warm_prefix)  # compiles this path's shapes (and the load's copies)
        llm.reset_stats()
        first = ttft(llm, timed_prefix, timed_suffix)
        token = first_tokens[-1]
        loaded = llm.stats.connector.tokens_loaded if llm.stats.connector else 0
        computed = llm.stats.prefill_tokens
        load_s = llm.stats.connector.load_seconds if llm.stats.connector else 0.0  # worker: reads + device copy
        stage_s = llm.stats.connector.stage_seconds if llm.stats.connector else 0.0  # of which the device copy
        local = ttft(llm, timed_prefix)  # the prefix is now in the device prefix cache
        bytes_loaded = loaded * sum(f.token_bytes for f in llm.layout.attention) + (
            llm.layout.state.slot_bytes if llm.layout.state and loaded else 0)
        rows.append({
            "device": device.device_kind, "date": time.strftime("%Y-%m-%d"),
            "config": os.path.basename(os.path.normpath(args.config_dir)), "placement": name, "tp": tp or "none",
            "mode": mode, "prefix": n, "suffix": args.suffix_len, "ttft_ms": round(first * 1e3, 1),
            "tokens_loaded": loaded, "prefill_tokens": computed,
            "loaded_GB": round(bytes_loaded / 1e9, 3),
            "load_GB_s": round(bytes_loaded / 1e9 / first, 2) if loaded else 0.0,
            "load_worker_ms": round(load_s * 1e3, 1), "load_copy_ms": round(stage_s * 1e3, 1),
            "local_hit_ttft_ms": round(local * 1e3, 1), "first_token": token,
        })
        rows[-1]["same_token"] = token == rows[0]["first_token"]  # loaded prefix vs recomputed, greedy
        rows[-1]["speedup"] = round(rows[0]["ttft_ms"] / rows[-1]["ttft_ms"], 2)
        del llm
        gc.collect()
    if not args.kv_path:
        shutil.rmtree(disk_dir, ignore_errors=True)
    del model, stores
    gc.collect()
    return rows


if __name__ == "__main__":
    sys.exit(main())
