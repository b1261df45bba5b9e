#!/usr/bin/env python3
"""Paged attention benchmark on the GPU: the Pallas decode kernel against the jnp reference op and JAX's own
(deprecated) Triton-Pallas paged attention, with parity and HBM-bandwidth figures.

    python scripts/bench_attention.py                       # decode section, all cases, default kernel config
    python scripts/bench_attention.py --sweep --json out.json   # also sweep block configs, report the best
    python scripts/bench_attention.py --dry-run             # tiny shapes, interpret mode, CPU: checks the script

    python scripts/bench_attention.py --section layers --batch-sizes 1 8 32 --heads 14 --groups 2 --dim 64 \
        --page-size 16 --context 1024 --schedule default 128x4 64x9   # the engine's decode attention layer

Layers (``--section layers``): the engine's decode attention layer (RoPE on the new query and key, the page
write, paged attention and the XLA merge of the K-splits: ``rope_write_paged_attention_decode``) for
``--layers`` layers of their own K/V pools chained in a device loop of ``--loop`` iterations (each layer's
output becomes the next one's query, keys and values), so one call holds milliseconds of device work and the
host's dispatch stays off the clock; µs per layer, for each batch and each schedule (``default``, or
``BLOCKxSPLITS`` block tokens and K-splits, each optionally followed by ``:scalar`` / ``:vector`` page-id loads,
``:wN`` warps, ``:stN`` stages, ``:pfN`` blocks of ids loaded ahead, e.g. ``128x4:scalar:w8``).
``--table-pages`` widens the block tables as the engine's are (its decode tables span the prompt, the output and
a page; the split count follows the table's width).

Decode: B sequences (default 64) with 32 query / 8 KV heads, D = 128, bf16, one query token each, the K/V pool
in the engine's layout [P, page_size, G, D] with block tables in a random page order. Cases: contexts 1024, 4096
and 16384 at page size 64, 4096 at page size 16, and a sliding-window family (window 4096 at context 16384, whose
table keeps only the window's pages, as the engine does). Contexts are jittered by up to one page so rows end
mid-page.

Each timing is the median over several trials of (a run of back-to-back calls / calls), after warm-up, cycling
over ``--pools`` independent K/V pools (and tables and queries) so the 50 MB L2 never holds the next call's
K/V. Bytes = the K/V bytes a row can see (its visible keys x G x D x 2 tensors x 2 bytes), which is the floor
any kernel must read; TB/s and % of the measured HBM bandwidth (``apriel2_jax.benchmarking.hbm_bandwidth``)
follow from it. Parity: relative max error vs the jnp reference op; the kernel's output buffer is requested
right after freeing a NaN-filled buffer of the same size, so unwritten elements would likely show as NaN.

JAX's op takes [G, P, page_size, D] pages and lengths instead of positions (converted once, outside the
timing); it has no sliding window or first page, so on the window case it runs over the same window table with
lengths measured from the table's start (same bytes, not the same mask: timing only).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from apriel2_jax.benchmarking import hbm_bandwidth, paged_decode_inputs, print_rows, time_looped  # noqa: E402
from apriel2_jax.ops.paged_attention import paged_attention as reference_op  # noqa: E402
from pallas_kernels.paged_attention_decode import (  # noqa: E402
    paged_attention_decode, rope_write_paged_attention_decode, table_schedule)


def log(*a):
    print(*a, flush=True)


def make_case(seed, batch, heads, groups, dim, context, page_size, window, dtype):
    """One pool, its block tables, queries and positions (K/V/q drawn on the device: a 16K-context pool is 4 GB).
    Window families keep only the pages that can hold keys inside the window (width = ceil(window / page_size)
    + 1) and start their tables at first_page."""
    rng = np.random.default_rng(seed)
    positions = context - 1 - rng.integers(0, page_size, batch)
    if window is None:
        width = -(-context // page_size)
        first = np.zeros(batch, np.int64)
    else:
        width = -(-window // page_size) + 1
        first = np.maximum((positions - window + 1) // page_size, 0)
    last = positions // page_size  # last logical page of each row
    num_pages = batch * width + 1  # page 0: the sink
    perm = rng.permutation(np.arange(1, num_pages)).reshape(batch, width)
    cols = np.arange(width)[None, :]
    table = np.where(first[:, None] + cols <= last[:, None], perm, 0).astype(np.int32)
    shape = (num_pages, page_size, groups, dim)
    kk, kv, kq = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(kk, shape, dtype)
    v = jax.random.normal(kv, shape, dtype)
    q = jax.random.normal(kq, (batch, 1, heads, dim), dtype)
    visible = positions + 1 if window is None else np.minimum(positions + 1, window)
    nbytes = int(visible.sum()) * groups * dim * 2 * jnp.dtype(dtype).itemsize
    return dict(q=q, k_pages=k, v_pages=v, block_table=jnp.asarray(table), first_page=jnp.asarray(first, jnp.int32),
                q_positions=jnp.asarray(positions[:, None], jnp.int32)), nbytes


def time_calls(fn, sets, trials, calls):
    """Median over trials of the mean time of ``calls`` back-to-back calls (one sync per trial), cycling inputs."""
    jax.block_until_ready(fn(sets[0]))  # compile
    for s in sets:
        jax.block_until_ready(fn(s))  # warm-up
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        out = None
        for i in range(calls):
            out = fn(sets[i % len(sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if not np.isfinite(a).all():
        return float("nan")
    return float(np.abs(a - b).max() / np.abs(b).max())


def nan_primed(fn, x, shape, dtype):
    """Run ``fn(x)`` right after freeing a NaN-filled buffer of the output's size (the allocator tends to hand
    it back), so elements the kernel failed to write would read NaN."""
    junk = jnp.full(shape, jnp.nan, dtype)
    junk.block_until_ready()
    del junk
    return jax.block_until_ready(fn(x))


def jax_baseline(interpret):
    """JAX's deprecated Triton-Pallas paged attention, or the import error."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
    except Exception as e:  # noqa: BLE001  (any import failure is reported, not fatal)
        return None, f"import failed: {type(e).__name__}: {e}"
    return jax_pa, None


def jax_inputs(x, page_size):
    """JAX's layout: pages [G, P, page_size, D], q [B, H, D] pre-scaled by D^-0.5 (JAX's op does not scale),
    lengths = tokens from the table's start."""
    lengths = x["q_positions"][:, 0] + 1 - x["first_page"] * page_size
    q = x["q"][:, 0]
    return dict(q=(q * q.shape[-1] ** -0.5).astype(q.dtype), k_pages=jnp.transpose(x["k_pages"], (2, 0, 1, 3)),
                v_pages=jnp.transpose(x["v_pages"], (2, 0, 1, 3)), block_tables=x["block_table"],
                lengths=lengths.astype(jnp.int32))


def jax_k_splits(width, want=16):
    """JAX's op needs k_splits to divide the table width."""
    return max(d for d in range(1, min(want, width) + 1) if width % d == 0)


def sweep_configs(page_size, dry_run, full):
    """(block_tokens, num_warps, num_stages, splits, prefetch_ids) configurations; splits None = automatic."""
    del page_size  # the kernel's block is in tokens, whatever the page size
    if dry_run:
        return [(16, 4, 2, 2, 1), (32, 4, 2, 1, 0)]
    if not full:
        return [(64, 4, 3, s, 1) for s in (1, 2, 4, 8)]
    configs = [(n, nw, ns, s, 1) for n in (64, 128) for nw, ns in ((4, 2), (4, 3), (4, 4), (8, 3), (8, 4))
               for s in (1, 2, 4, 8)]
    configs += [(32, 4, ns, s, 1) for ns in (3, 5) for s in (2, 4)]
    # Page ids loaded in the same iteration as their K/V, and two blocks ahead (see the kernel's prefetch_ids).
    configs += [(64, nw, ns, None, p) for p in (0, 2) for nw, ns in ((4, 3), (8, 3))]
    return configs


def decode_section(args, bandwidth):
    dry = args.dry_run
    dtype = jnp.bfloat16
    if dry:
        batch, heads, groups, dim = 2, 8, 2, 16
        cases = [(64, 16, None), (48, 8, None), (96, 16, 32)]
    else:
        batch, heads, groups, dim = args.batch, 32, 8, 128
        cases = [(4096, 64, None), (1024, 64, None), (16384, 64, None), (4096, 16, None), (16384, 64, 4096)]
    trials, calls = (1, 2) if dry else (args.trials, args.calls)
    jax_pa, jax_error = jax_baseline(dry)
    if jax_error:
        log(f"JAX deprecated paged attention unavailable: {jax_error}")
    rows = []
    for case_index, (context, page_size, window) in enumerate(cases):
        label = f"ctx={context} ps={page_size}" + (f" window={window}" if window else "")
        log(f"[decode] {label}: building {args.pools} pools ...")
        built = [make_case(100 * case_index + i, batch, heads, groups, dim, context, page_size, window, dtype) for i in range(args.pools)]
        sets = [b[0] for b in built]
        nbytes = statistics.mean(b[1] for b in built)
        width = sets[0]["block_table"].shape[1]

        ref_fn = jax.jit(lambda x: reference_op(**x, window=window))
        ref_out = jax.block_until_ready(ref_fn(sets[0]))

        def ours(cfg):
            n, nw, ns, splits, prefetch = cfg
            return jax.jit(lambda x: paged_attention_decode(
                **x, window=window, block_tokens=n, splits=splits, num_warps=nw, num_stages=ns,
                prefetch_ids=prefetch, interpret=dry))

        auto_block, auto_splits = table_schedule(batch, groups, width, page_size, window, dim, dtype)
        configs = [(auto_block, 4, 3, auto_splits, 1)]  # the kernel's defaults for bf16
        if args.sweep:
            configs += sweep_configs(page_size, dry, full=case_index == 0)
        results = []
        for cfg in configs:
            try:
                fn = ours(cfg)
                seconds = time_calls(fn, sets, trials, calls)
                results.append((seconds, cfg, fn))
                log(f"  ours block={cfg[0]} warps={cfg[1]} stages={cfg[2]} splits={cfg[3] or f'auto({auto_splits})'} "
                    f"prefetch_ids={cfg[4]}: {seconds * 1e6:.1f} us, {nbytes / seconds / 1e12:.3f} TB/s")
            except Exception as e:  # noqa: BLE001  (a config the GPU cannot take, e.g. too much shared memory)
                log(f"  ours {cfg}: failed: {type(e).__name__}: {str(e)[:200]}")
        default_s, default_cfg, default_fn = results[0] if results and results[0][1] == configs[0] else (None,) * 3
        best_s, best_cfg, best_fn = min(results, key=lambda r: r[0]) if results else (None,) * 3

        def parity(fn, x):
            return rel_err(nan_primed(fn, x, ref_out.shape, ref_out.dtype), ref_out)

        err_default = parity(default_fn, sets[0]) if default_fn else float("nan")
        err_best = parity(best_fn, sets[0]) if best_fn else float("nan")
        log(f"  parity vs jnp: default {err_default:.1e}, best {err_best:.1e}")

        log("  jnp reference ...")
        ref_s = time_calls(ref_fn, sets, trials, calls)

        jax_s, jax_note = None, jax_error or ""
        if jax_pa is not None:
            try:
                jsets = [jax_inputs(x, page_size) for x in sets]
                k_splits = jax_k_splits(width)
                jfn = jax.jit(lambda x: jax_pa.paged_attention(**x, k_splits=k_splits, interpret=dry))
                jout = jax.block_until_ready(jfn(jsets[0]))
                jax_note = "timing only (no window)" if window else f"err {rel_err(jout[:, None], ref_out):.1e}"
                jax_s = time_calls(jfn, jsets, trials, calls)
                del jsets
            except Exception as e:  # noqa: BLE001
                jax_note = f"failed: {type(e).__name__}: {str(e)[:160]}"
            log(f"  jax deprecated: {jax_note}" + (f", {jax_s * 1e6:.1f} us" if jax_s else ""))

        def tbps(s):
            return None if s is None else round(nbytes / s / 1e12, 3)

        def pct(s):
            return None if s is None or not bandwidth else round(100 * nbytes / s / bandwidth, 1)

        def us(s):
            return None if s is None else round(s * 1e6, 1)

        cfg_name = (lambda c: None if c is None else
                    f"n={c[0]} w={c[1]} st={c[2]} sp={c[3] or f'auto({auto_splits})'}{'' if c[4] == 1 else f' prefetch={c[4]}'}")
        rows.append(dict(
            case=label, batch=batch, heads=f"{heads}/{groups}", dim=dim, MB=round(nbytes / 1e6, 1),
            ours_us=us(default_s), ours_TBps=tbps(default_s), ours_pct_hbm=pct(default_s), ours_err=f"{err_default:.1e}",
            best_us=us(best_s), best_TBps=tbps(best_s), best_pct_hbm=pct(best_s), best_err=f"{err_best:.1e}",
            best_cfg=cfg_name(best_cfg), jnp_us=us(ref_s), jnp_TBps=tbps(ref_s), jax_us=us(jax_s), jax_TBps=tbps(jax_s),
            jax_note=jax_note,
        ))
        del sets, built, results, default_fn, best_fn
        gc.collect()
    return rows


def layer_chain_case(batch, heads, groups, dim, context, page_size, layers, seed=0, width=None):
    """Inputs of one decode step at ``context`` tokens per row (random page order, every row at the same
    position; tables of ``width`` pages, default just enough) and ``layers`` K/V pools of their own."""
    width = width or -(-(context + 1) // page_size)
    inputs, qkv, pools = paged_decode_inputs(batch, heads, groups, dim, context, page_size, width, pools=layers,
                                             seed=seed)
    return inputs, (qkv, pools)


def layer_chain_us(inputs, carry, groups, loop, interpret=False, repeats=3, **schedule):
    """µs per layer of the chain (``time_looped``: ``repeats`` rounds of 3 calls), and the carry (donated from
    call to call: the caller's is consumed)."""
    layers = len(carry[1])

    def step(x, carry):
        def body(_, c):
            qkv, pools = c
            new = []
            for k_pages, v_pages in pools:
                out, k_pages, v_pages = rope_write_paged_attention_decode(
                    qkv, None, None, x["cos"], x["sin"], x["slots"], k_pages, v_pages, x["table"], x["first"],
                    x["positions"], interpret=interpret, **schedule)
                new.append((k_pages, v_pages))
                qkv = jnp.concatenate([out, out[:, : 2 * groups]], axis=1)
            return qkv, new
        return jax.lax.fori_loop(0, loop, body, carry)

    seconds, carry = time_looped(step, [inputs], carry, steps=3, repeats=repeats)
    return seconds / (layers * loop) * 1e6, carry


_SCHEDULE_OPTIONS = {"w": "num_warps", "st": "num_stages", "pf": "prefetch_ids"}


def parse_schedule(text: str) -> dict:
    """``default`` or ``BLOCKxSPLITS`` (e.g. ``128x4``), then optional ``:``-separated options: ``scalar`` or
    ``vector`` (how a block's page ids are loaded), ``wN`` (num_warps), ``stN`` (num_stages), ``pfN``
    (prefetch_ids); e.g. ``128x4:scalar:w8`` -> the kernel's keyword arguments."""
    head, *options = text.split(":")
    kwargs = {}
    for option in options:
        name = option.rstrip("0123456789")
        if option in ("scalar", "vector"):
            kwargs["page_ids"] = option
        elif name in _SCHEDULE_OPTIONS and option[len(name):]:
            kwargs[_SCHEDULE_OPTIONS[name]] = int(option[len(name):])
        else:
            raise argparse.ArgumentTypeError(f"schedule option {option!r} in {text!r}: expected scalar, vector, "
                                             "wN, stN or pfN")
    if head == "default":
        return kwargs
    try:
        block, splits = (int(part) for part in head.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"schedule {text!r}: expected 'default' or BLOCKxSPLITS, e.g. 128x4")
    return dict(block_tokens=block, splits=splits, **kwargs)


def layers_section(args):
    dry = args.dry_run
    if dry:
        heads, groups, dim, context, page_size, layers, loop = 4, 2, 16, 40, 8, 2, 2
        batches = [1, 2]
    else:
        heads, groups, dim, context, page_size, layers, loop = (args.heads, args.groups, args.dim, args.context,
                                                                  args.page_size, args.layers, args.loop)
        batches = args.batch_sizes
    rows = []
    for batch in batches:
        inputs, carry = layer_chain_case(batch, heads, groups, dim, context, page_size, layers,
                                         width=args.table_pages)
        width = inputs["table"].shape[1]
        auto = table_schedule(batch, groups, width, page_size, None, dim, jnp.bfloat16)
        for text in args.schedule:
            schedule = parse_schedule(text)
            us, carry = layer_chain_us(inputs, carry, groups, loop, interpret=dry, repeats=1 if dry else 3,
                                       **schedule)
            block, splits = (schedule["block_tokens"], schedule["splits"]) if "splits" in schedule else auto
            log(f"[layers] B={batch} block={block} splits={splits}: {us:.2f} us per layer")
            rows.append(dict(section="layers", batch=batch, heads=f"{heads}/{groups}", dim=dim, context=context,
                             page_size=page_size, schedule=text, block_tokens=block, splits=splits,
                             us_per_layer=round(us, 2)))
        del inputs, carry
        gc.collect()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--section", default="all", choices=["all", "decode", "layers"],
                    help="all: the decode section; layers: the engine's decode attention layer chained (see above)")
    ap.add_argument("--batch", type=int, default=64, help="decode section: sequences")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="layers section: batches")
    ap.add_argument("--heads", type=int, default=14, help="layers section: query heads (default: the 0.5B's)")
    ap.add_argument("--groups", type=int, default=2, help="layers section: KV heads")
    ap.add_argument("--dim", type=int, default=64, help="layers section: head dim")
    ap.add_argument("--page-size", type=int, default=16, help="layers section")
    ap.add_argument("--context", type=int, default=1024, help="layers section: tokens before the new one")
    ap.add_argument("--table-pages", type=int, default=None,
                    help="layers section: block table width in pages (default: the context's; bench_generate.py's "
                         "engine runs (prompt + output) / page size + 1)")
    ap.add_argument("--layers", type=int, default=24, help="layers section: chained layers (own K/V pools)")
    ap.add_argument("--loop", type=int, default=10, help="layers section: device-loop iterations per call")
    ap.add_argument("--schedule", nargs="+", default=["default"],
                    help="layers section: 'default' and/or BLOCKxSPLITS entries (block tokens x K-splits), each "
                         "optionally with options (parse_schedule), e.g. 128x4:scalar:w8")
    ap.add_argument("--pools", type=int, default=3, help="independent K/V pools cycled through (defeats L2)")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10, help="back-to-back calls per trial")
    ap.add_argument("--sweep", action="store_true", help="sweep kernel block configs (full grid on the first case)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes in interpret mode on CPU")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    if args.dry_run:
        jax.config.update("jax_platforms", "cpu")
        args.pools = min(args.pools, 2)
    device = jax.devices()[0].device_kind
    log(f"device: {device}, jax {jax.__version__}")
    bandwidth = None
    if not args.dry_run:
        log("measuring HBM bandwidth ...")
        bandwidth = hbm_bandwidth()
        log(f"HBM bandwidth: {bandwidth / 1e12:.3f} TB/s")
    started = time.perf_counter()
    rows = []
    for text in args.schedule:
        try:
            parse_schedule(text)
        except argparse.ArgumentTypeError as err:
            ap.error(str(err))
    if args.section in ("all", "decode"):
        rows += decode_section(args, bandwidth)
    if args.section == "layers":
        rows += layers_section(args)
    for r in rows:
        r.update(device=device, date=time.strftime("%Y-%m-%d"),
                 hbm_TBps=None if bandwidth is None else round(bandwidth / 1e12, 3))
    log(f"\ndone in {time.perf_counter() - started:.0f} s\n")
    print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
