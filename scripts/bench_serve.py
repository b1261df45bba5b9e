#!/usr/bin/env python3
"""Serving benchmark: the OpenAI-compatible server under Poisson arrivals at a sweep of request rates.

    python scripts/bench_serve.py ../shared/configs/superapriel-15b-shaped --placement all-attention a12-g1-k11 \
        --rates 1,4,16,inf --requests 256 --prompt-len 1024 --output-len 128

For each placement (a process of its own when several are given): random weights of the config's geometry, pruned to the placement (``bench_generate.py``'s
``random_model``), an ``LLM`` served by uvicorn in this process on 127.0.0.1, and an async HTTP client (httpx)
that sends ``--requests`` streamed completions (random token-id prompts of ``--prompt-len`` tokens, exactly
``--output-len`` greedy tokens each) with exponential gaps at each rate (``inf``: all at once). Before the sweep the
engine compiles the step shapes the workload can run (``--warm-up workload``: every decode batch, and prefill steps of
any row count at the prompts' width) and a warm-up round runs the workload once; each row reports the steps that
still compiled during it (``compiled_steps``, 0 for a clean row). Reported per rate, from the client's side:
request throughput, output tokens/s, p50/p99 time to first token and p50/p99 inter-token latency (the gap
between two chunks spread over the tokens of the later chunk: a decode dispatch brings several at once).
``--url`` drives a server that is already running (``apriel2-serve``) instead. ``--json PATH`` appends the rows.

Needs the ``serve`` extra (fastapi, uvicorn) and httpx. A CPU smoke run on a golden checkpoint:

    python scripts/bench_serve.py ../shared/goldens/hybrid_all_mixers --placement mamba --dtype float32 \
        --requests 8 --prompt-len 16 --output-len 8 --rates 4,inf --max-num-seqs 4 --page-size 4
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import sys
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(SCRIPTS, ".."))
sys.path.insert(0, SCRIPTS)

import httpx  # noqa: E402
import numpy as np  # noqa: E402


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        rate = math.inf if part in ("inf", "infinity") else float(part)
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    return rates


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config_dir", help="a config directory (config.json, placements.json) or a checkpoint")
    ap.add_argument("--placement", nargs="+", default=[None], help="placement names (one sweep each)")
    ap.add_argument("--rates", type=parse_rates, default=parse_rates("1,4,16,inf"),
                    help="requests per second, comma-separated; inf sends them all at once (default 1,4,16,inf)")
    ap.add_argument("--requests", type=int, default=128, help="requests per rate (default 128)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    g = ap.add_argument_group("engine (the server's LLM)")
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N")
    g.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    g.add_argument("--page-size", type=int, default=None, help="default: the engine's")
    g.add_argument("--decode-steps", type=int, default=None, help="default: the engine's")
    g.add_argument("--cache-memory-fraction", type=float, default=None, help="default: the engine's")
    g.add_argument("--warm-up", default="workload", choices=("none", "few", "workload", "all"),
                   help="step shapes the engine compiles before serving (default workload: every decode batch and "
                        "every prefill step of --prompt-len prompts, so none compiles mid-sweep; all: every shape)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    g.add_argument("--max-queued-requests", type=int, default=None, help="default: --requests")
    ap.add_argument("--url", default=None,
                    help="benchmark the server at this URL (e.g. http://127.0.0.1:8000) instead of starting one; "
                         "--placement and the engine flags are then only labels / ignored")
    ap.add_argument("--model", default=None, help="with --url: the served model name (default: the first listed)")
    ap.add_argument("--json", default=None, help="append the result rows to this JSONL file")
    return ap


# ------------------------------------------------------------------------------------------------------------
# Client side
# ------------------------------------------------------------------------------------------------------------


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int, start_at: float,
               t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    sent = time.perf_counter()
    first, last, tokens, gaps = None, None, 0, []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": event["error"]["message"]}
            n = sum(len(c.get("token_ids", [])) for c in event["choices"])
            if not n:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps += [(now - last) / n] * n
            last = now
            tokens += n
    return {"ttft": first - sent, "itl": gaps, "tokens": tokens, "latency": last - sent, "end": last}


async def run_rate(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float,
                   rng: np.random.Generator) -> dict:
    gaps = np.zeros(len(prompts)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(prompts))
    starts = np.cumsum(gaps) - gaps[0]
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(3600.0)) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, model, p, output_len, float(s), t0)
                                         for p, s in zip(prompts, starts)))
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        print(f"rate {rate}: {len(errors)} requests failed, e.g. {errors[0]}", file=sys.stderr)
    duration = max((r["end"] for r in ok), default=t0) - t0
    ttft = np.array([r["ttft"] for r in ok]) * 1e3
    itl = np.array([g for r in ok for g in r["itl"]]) * 1e3
    pct = lambda a, q: round(float(np.percentile(a, q)), 2) if a.size else float("nan")  # noqa: E731
    tokens = sum(r["tokens"] for r in ok)
    return {
        "rate": "inf" if math.isinf(rate) else rate, "requests": len(prompts), "failed": len(errors),
        "duration_s": round(duration, 2),
        "req_s": round(len(ok) / duration, 3) if duration else 0.0,
        "output_tok_s": round(tokens / duration, 1) if duration else 0.0,
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
        "latency_mean_s": round(float(np.mean([r["latency"] for r in ok])), 2) if ok else float("nan"),
    }


def workload(args, vocab_size: int, rng: np.random.Generator) -> list[list[int]]:
    # Random ids (3 and up: past the usual special tokens), so prompts share no prefix.
    return [[int(t) for t in rng.integers(3, vocab_size, size=args.prompt_len)] for _ in range(args.requests)]


def workload_shapes(llm, prompt_len: int) -> list[tuple[int, int]]:
    """The step shapes serving ``prompt_len``-token prompts can run: every decode batch, and prefill steps of any
    row count at the width a whole prompt (or a chunk of it) takes."""
    buckets = llm.buckets
    shapes = {(rows, 1) for rows in buckets.decode_rows}
    width = min(prompt_len, llm.scheduler_config.max_chunk)
    for rows in buckets.prefill_rows:
        try:
            shapes.add(buckets.pick("prefill", rows, width))
        except ValueError:  # more rows of this width than the token budget holds
            pass
    return sorted(shapes)


def sweep(args, url: str, model: str, vocab_size: int, label: dict, compilations=None) -> list[dict]:
    """``compilations``: a callable giving the engine's count of compiled steps (in-process servers), so each row
    says how many compiled during it."""
    rng = np.random.default_rng(args.seed)
    # Warm-up: compile the prefill and decode shapes of this workload (a full batch, then stragglers).
    warm = workload(args, vocab_size, rng)[: max(1, min(args.requests, 2 * (args.max_num_seqs or 64)))]
    t = time.monotonic()
    asyncio.run(run_rate(url, model, warm, args.output_len, math.inf, rng))
    asyncio.run(run_rate(url, model, warm[:1], args.output_len, math.inf, rng))
    print(f"warm-up: {time.monotonic() - t:.1f}s", file=sys.stderr)
    rows = []
    for rate in args.rates:
        row = dict(label)
        before = compilations() if compilations else None
        row.update(asyncio.run(run_rate(url, model, workload(args, vocab_size, rng), args.output_len, rate, rng)))
        if compilations:
            row["compiled_steps"] = compilations() - before
        print(json.dumps(row), file=sys.stderr)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------------------
# Server side
# ------------------------------------------------------------------------------------------------------------


def serve_placement(args, raw: dict, named: dict, name: str | None) -> list[dict]:
    import jax

    from apriel2_jax.config import parse_config
    from apriel2_jax.engine.llm import LLM
    from apriel2_jax.placement import resolve_placement
    from apriel2_jax.server import BackgroundServer, create_app
    from bench_generate import random_model

    supernet = parse_config(raw)
    placement = resolve_placement(supernet, name, named)
    tp = args.tensor_parallel if args.tensor_parallel > 1 else None
    config, model, params, _ = random_model(args, raw, placement, name or "default", tp)
    kwargs = {k: v for k, v in dict(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
        decode_steps=args.decode_steps, cache_memory_fraction=args.cache_memory_fraction).items() if v is not None}
    page = args.page_size or 16
    max_len = -(-(args.prompt_len + args.output_len + 1) // page) * page
    # The thinned model has one mixer per layer: its default placement is the one asked for.
    llm = LLM(model=model, max_model_len=max_len, enable_prefix_caching=args.prefix_caching,
              warm_up="few" if args.warm_up == "workload" else args.warm_up, **kwargs)
    if args.warm_up == "workload":
        llm.compile_steps(workload_shapes(llm, args.prompt_len))
    app = create_app(llm, model_name="bench", max_queued_requests=args.max_queued_requests or args.requests * 2)
    label = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
             "config": os.path.basename(os.path.normpath(args.config_dir)), "placement": name or "default",
             "tp": args.tensor_parallel, "params_b": round(params / 1e9, 2), "prompt_len": args.prompt_len,
             "output_len": args.output_len, "max_num_seqs": llm.scheduler_config.max_num_seqs}
    with BackgroundServer(app) as server:
        rows = sweep(args, server.url, "bench", config.vocab_size, label,
                     functools.partial(getattr, llm.runner, "compilations"))
        metrics = httpx.get(server.url + "/metrics").text
    preempt = [line for line in metrics.splitlines() if line.startswith("apriel2_engine_preemptions_total")]
    print(f"{name}: {preempt[0] if preempt else ''}", file=sys.stderr)
    return rows


def _each_placement_in_its_own_process(argv: list[str], args) -> list[dict]:
    """One child process per placement: a process's device memory (the engine's caches take most of it) is only
    certain to be free when the process ends. Each child appends its rows to the JSONL (``--json``, else a
    temporary file) as it finishes, so a later placement failing loses nothing."""
    import subprocess
    import tempfile

    rest, skip = [], False
    for arg in argv:  # the arguments without the placement list and the JSONL path
        if arg in ("--placement", "--json"):
            skip = True
            continue
        if skip and not arg.startswith("--"):
            continue
        skip = False
        rest.append(arg)
    with tempfile.TemporaryDirectory() as scratch:
        path = args.json or os.path.join(scratch, "rows.jsonl")
        start = os.path.getsize(path) if os.path.exists(path) else 0
        for name in args.placement:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), *rest, "--placement", name,
                                   "--json", path])
            if done.returncode:
                print(f"placement {name}: the benchmark process exited with {done.returncode}", file=sys.stderr)
        with open(path) as f:
            f.seek(start)
            return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> int:
    from apriel2_jax.benchmarking import append_jsonl, print_rows

    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.prompt_len < 1 or args.output_len < 1:
        print("--requests, --prompt-len and --output-len must be >= 1", file=sys.stderr)
        return 2
    rows = []
    if args.url:
        models = httpx.get(args.url.rstrip("/") + "/v1/models").json()["data"]
        model = args.model or models[0]["id"]
        with open(os.path.join(args.config_dir, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        rows = sweep(args, args.url.rstrip("/"), model, vocab, {"url": args.url, "model": model})
    else:
        from apriel2_jax.placement import load_placements

        with open(os.path.join(args.config_dir, "config.json")) as f:
            raw = json.load(f)
        named = load_placements(args.config_dir) if os.path.exists(
            os.path.join(args.config_dir, "placements.json")) else {}
        if len(args.placement) == 1:
            rows = serve_placement(args, raw, named, args.placement[0])
            if args.json:
                append_jsonl(args.json, rows)
        else:
            rows = _each_placement_in_its_own_process(argv if argv is not None else sys.argv[1:], args)
    if args.url and args.json:
        append_jsonl(args.json, rows)
    print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
