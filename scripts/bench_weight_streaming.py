#!/usr/bin/env python3
"""How fast a decode step can stream its weights: one kernel per matrix against one kernel for all of them, and
what a dependence between matrices costs either way.

    python scripts/bench_weight_streaming.py [--n 9728 --k 896 --layers 24] [--config 64,128,8 ...] [--programs 76 132]
        [--json PATH]

A decode step at small batch reads every weight once and does little arithmetic, so its floor is bytes over
bandwidth. Ways to read ``--layers`` bf16 matrices of [N, K] (default: the 0.5B geometry's gate and up
projections side by side, 17.4 MB per layer), each call of the timed step waiting on the one before
(``benchmarking.time_looped``: median of 5 rounds of 20 calls). Every kernel is one Mosaic GPU CTA per SM that
streams its share of a matrix's [bn, bk] blocks through a ring of ``depth`` SMEM stages filled by TMA
(``--config bn,bk,depth``) and reads one element of each, so the loads are used; a CTA's share is a contiguous
range of blocks, balanced to within one. ``--programs`` streams with fewer CTAs than SMs as well (one row set per
count), to ask whether a kernel that leaves SMs idle can still reach the bandwidth.

- **per-matrix kernels**: one kernel per matrix, each reading the previous one's output (a true dependence, as a
  layer's projections have): every matrix pays a kernel's start and tail.
- **per-matrix kernels, PDL**: the same with programmatic dependent launch: each kernel lets the next launch at
  once (``griddepcontrol.launch_dependents``) and issues its first weight loads before waiting for the previous
  kernel (``griddepcontrol.wait``), so a weight stream could start under the previous kernel's tail where a
  CTA of each fits on an SM (``depth`` stages of [bn, bk] within half of the SMEM: e.g. 32,128,12 but not
  64,128,8).
- **one kernel**: the matrices in one kernel: the bytes of all layers with a single start and tail.
- **one kernel, grid barrier per matrix**: one persistent kernel in which every CTA waits for all others after
  each matrix (a global counter: a release add, then polling), as phases that depend on each other's results
  would; the next matrix's first loads are in flight across the barrier.
- **grid barriers alone**: the same barriers without the weights: a barrier's own cost.
- **decode GEMV**: ``pallas_kernels.decode_gemv.norm_gated_mlp_kernel`` (RMSNorm + gate/up + activation product,
  one row) once per layer: the engine's kernel on the same bytes, arithmetic included.

``--launch-cost`` measures instead what a kernel boundary costs without any bytes: chains of tiny dependent
kernels (each adds to a 128-float vector the previous one wrote) of each kind, an XLA fusion, a Pallas Triton
kernel (one program) and a Mosaic GPU kernel (one CTA, and one per SM), 16 in each iteration of a 16-iteration
device loop (as the engine's decode dispatch runs its steps): µs per kernel.

``--pdl-overlap`` asks whether XLA launches a Pallas Triton kernel so that it can start under the kernel before it
(programmatic dependent launch): kernel A lets its dependents launch at once (``griddepcontrol.launch_dependents``)
and then spins for 40 µs; kernel B, which reads A's output, stamps the global timer before its
``griddepcontrol.wait``. B's start minus A's end, µs: about -40 where B started under A, a fraction of a µs after
it where B waited for A to finish. Run it under each ``XLA_FLAGS`` setting of interest (``--xla_gpu_enable_pdl``,
command buffers off).

Needs a GPU (Mosaic GPU kernels do not run on the CPU).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

from apriel2_jax.benchmarking import hbm_bandwidth, print_rows, time_looped  # noqa: E402
from pallas_kernels.decode_gemv import norm_gated_mlp_kernel  # noqa: E402

F32 = jnp.float32


def stream_blocks(w: jax.Array, x: jax.Array, *, matrices: int, programs: int, bn: int, bk: int, depth: int,
                  pdl: bool = False, barrier: bool = False, weights: bool = True) -> jax.Array:
    """Read ``matrices`` stacked [N, K] matrices (``w``: [matrices * N, K]) through SMEM, matrix after matrix.
    Returns one float per CTA, padded to ``carry_size(programs)``; ``x`` of that size (the previous kernel's
    output) is read before the first block is used, so a chain of calls is a chain of dependent kernels. ``barrier``: all CTAs meet after each matrix.
    ``weights=False`` skips the loads (barriers alone)."""
    total_n, k = w.shape
    n = total_n // matrices
    if n * matrices != total_n or n % bn or k % bk:
        raise ValueError(f"--config {bn},{bk},{depth}: the blocks must divide each [{n}, {k}] matrix")
    units = (n // bn) * (k // bk)  # [bn, bk] blocks of one matrix, row-major
    if units < programs:
        raise ValueError(f"--config {bn},{bk},{depth}: {units} blocks per matrix leave some of the {programs} "
                         "CTAs without one; use smaller blocks")

    def body(w_gmem, x_gmem, out_gmem, scratch):
        (w_smem, x_smem), (ready, x_ready) = scratch
        p = lax.axis_index("p")
        first, last = p * units // programs, (p + 1) * units // programs
        mine = last - first
        steps = mine * matrices if weights else 0
        counter = pl.get_global(plgpu.SemaphoreType.REGULAR((2,))) if barrier else None

        def issue(step):
            unit = first + step % mine
            row = (step // mine) * n + (unit // (k // bk)) * bn
            plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(row, bn), pl.ds((unit % (k // bk)) * bk, bk)],
                                    w_smem.at[step % depth], ready.at[step % depth])

        if pdl:
            plgpu.griddepcontrol_launch_dependents()
        for step in range(depth):
            pl.when(step < steps)(functools.partial(issue, step))
        if pdl:
            plgpu.griddepcontrol_wait()
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, x_ready.at[0])
        plgpu.barrier_wait(x_ready.at[0])

        def matrix(m, total):
            def block(i, total):
                step = m * mine + i
                plgpu.barrier_wait(ready.at[step % depth])
                total = total + w_smem[step % depth, 0, 0].astype(F32)

                @pl.when(step + depth < steps)
                def _():
                    issue(step + depth)
                return total

            if weights:
                total = lax.fori_loop(0, mine, block, total)
            if barrier:
                plgpu.semaphore_signal(counter.at[0], 1, memory_scope="gpu")
                plgpu.semaphore_wait(counter.at[0], (m + 1) * programs, decrement=False, memory_scope="gpu")
            return total

        total = lax.fori_loop(0, matrices, matrix, jnp.float32(0.0))
        if barrier:  # leave the counter at zero for the next call: CTA 0 resets it once every CTA is past it
            plgpu.semaphore_signal(counter.at[1], 1, memory_scope="gpu")

            @pl.when(p == 0)
            def _():
                plgpu.semaphore_wait(counter.at[1], programs, memory_scope="gpu")
                plgpu.semaphore_signal(counter.at[0], -matrices * programs, memory_scope="gpu")
        out_gmem[p] = 0.5 * total + 0.5 * x_smem[p]

    def entry(*refs):
        pl.run_scoped(lambda *s: body(*refs, s),
                      (plgpu.SMEM((depth, bn, bk), w.dtype), plgpu.SMEM(x.shape, F32)),
                      (plgpu.Barrier(num_barriers=depth), plgpu.Barrier(num_barriers=1)))

    if x.shape != (carry_size(programs),):
        raise ValueError(f"x must be [{carry_size(programs)}] (carry_size), got {list(x.shape)}")
    return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct(x.shape, F32), grid=(programs,),
                        grid_names=("p",))(w, x)


def carry_size(programs: int) -> int:
    """Floats in the carry between kernels: one per CTA, padded to 16 bytes (a TMA copy's granule)."""
    return -(-programs // 4) * 4


def per_layer_us(step, weights, carry, layers: int) -> float:
    """µs per layer of ``carry = step(weights, carry)``, each call waiting on the one before (``time_looped``:
    median of 5 rounds of 20 calls)."""
    seconds, _ = time_looped(step, [weights], carry, steps=20, repeats=5)
    return seconds / layers * 1e6


def tiny_kernels() -> dict:
    """One-step ops on a float32 vector, each its own kernel: name -> (op, vector length)."""
    def xla(x):
        return lax.optimization_barrier(x * 1.0001 + 1.0)  # the barrier keeps XLA from fusing the chain

    def triton(x):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 1.0001 + 1.0
        return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, F32),
                              compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(x)

    def mosaic(x, programs=1):
        def body(x_gmem, o_gmem):
            def scoped(x_smem, ready):
                plgpu.copy_gmem_to_smem(x_gmem, x_smem, ready.at[0])
                plgpu.barrier_wait(ready.at[0])
                p = lax.axis_index("p")
                o_gmem[p] = x_smem[p] * 1.0001 + 1.0
            pl.run_scoped(scoped, plgpu.SMEM(x.shape, F32), plgpu.Barrier(num_barriers=1))
        return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, F32), grid=(programs,),
                            grid_names=("p",))(x)

    sms = jax.devices()[0].core_count
    return {"XLA fusion": (xla, 128), "Pallas Triton, 1 program": (triton, 128),
            "Mosaic GPU, 1 CTA": (mosaic, 128),
            f"Mosaic GPU, {sms} CTAs": (functools.partial(mosaic, programs=sms), carry_size(sms))}


def launch_cost_rows(per_iteration: int = 16, iterations: int = 16) -> list[dict]:
    """µs per tiny dependent kernel of each kind: ``per_iteration`` kernels in each iteration of a device loop of
    ``iterations`` (as the engine's decode dispatch runs its steps), so a call is device-bound, not host-bound."""
    def looped(op):
        def step(_, x):
            def body(i, x):
                for _ in range(per_iteration):
                    x = op(x)
                return x
            return lax.fori_loop(0, iterations, body, x)
        return step

    device = jax.devices()[0].device_kind
    rows = []
    for name, (op, size) in tiny_kernels().items():
        seconds, _ = time_looped(looped(op), [None], jnp.zeros((size,), F32), steps=10, repeats=5)
        rows.append(dict(device=device, kernel=name, kernels_per_call=per_iteration * iterations,
                         us_per_kernel=round(seconds / (per_iteration * iterations) * 1e6, 2)))
    return rows


PDL_SPIN_NS = 40_000


def _asm_i32(text: str, arg: jax.Array) -> jax.Array:
    """Inline PTX ``text`` with one int32 input and output per element (``$1``, ``$0``)."""
    [out] = pltriton.elementwise_inline_asm(text, args=[arg], constraints="=r,r", pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(arg.shape, jnp.int32)])
    return out


def _global_timer(after: jax.Array) -> jax.Array:
    """The global timer's low 32 bits (ns), read after ``after`` is known (so no read moves above it)."""
    return _asm_i32("mov.u32 $0, %globaltimer_lo; // $1", after)


def pdl_overlap_rows(lanes: int = 16, iterations: int = 8) -> list[dict]:
    """B's start minus A's end (µs) for a Pallas Triton kernel A that triggers its dependents at once (or not) and
    spins ``PDL_SPIN_NS``, and a kernel B reading A's output that stamps the timer before ``griddepcontrol.wait``
    (see above): once, and in a device loop of ``iterations`` pairs, each pair's A taking the pair before as an
    operand (where XLA may put the kernels in a command buffer)."""
    i32 = jnp.int32
    params = pltriton.CompilerParams(num_warps=1, num_stages=1)

    def spin(x_ref, previous_ref, o_ref, *, trigger):
        del previous_ref  # an operand only: it orders this kernel after the previous pair
        x = x_ref[...]
        if trigger:
            x = _asm_i32("griddepcontrol.launch_dependents; mov.u32 $0, $1;", x)
        start = _global_timer(x)
        o_ref[...] = lax.while_loop(lambda t: jnp.min(t - start) < PDL_SPIN_NS, _global_timer, start)

    def stamp(a_ref, o_ref):
        started = _global_timer(jnp.zeros((lanes,), i32) + pl.program_id(0))
        # A zero the compiler cannot see through, from the wait's asm: A's output is addressed through it, so the
        # load stays after the wait and the wait stays in the kernel.
        zero = jnp.min(_asm_i32("griddepcontrol.wait; mov.u32 $0, 0; // $1", started))
        o_ref[pl.ds(0, lanes)] = started
        o_ref[pl.ds(lanes, lanes)] = a_ref[pl.ds(zero, lanes)]

    def pair(x, previous, trigger):
        a = pl.pallas_call(functools.partial(spin, trigger=trigger), grid=(1,), compiler_params=params,
                           out_shape=jax.ShapeDtypeStruct((lanes,), i32), name="pdl_spin")(x, previous)
        return pl.pallas_call(stamp, grid=(1,), compiler_params=params,
                              out_shape=jax.ShapeDtypeStruct((2 * lanes,), i32), name="pdl_stamp")(a)

    device = jax.devices()[0].device_kind
    flags = os.environ.get("XLA_FLAGS", "")
    x = jnp.zeros((lanes,), i32)
    rows = []
    for trigger in (True, False):
        once = jax.jit(lambda x, t=trigger: pair(x, jnp.zeros((2 * lanes,), i32), t)[None])

        @jax.jit
        def looped(x, t=trigger):
            def body(i, stamps):
                return stamps.at[i].set(pair(x, stamps[jnp.maximum(i - 1, 0)], t))
            return lax.fori_loop(0, iterations, body, jnp.zeros((iterations, 2 * lanes), i32))

        for way, fn in (("once", once), (f"device loop of {iterations}", looped)):
            stamps = jnp.concatenate([fn(x) for _ in range(5)])
            gaps = (stamps[:, 0] - stamps[:, lanes]).astype(jnp.float32) / 1e3  # int32 wrap-around is exact
            rows.append(dict(device=device, xla_flags=flags or "-", a_triggers=trigger, way=way,
                             b_start_minus_a_end_us_median=round(float(jnp.median(gaps)), 2),
                             b_start_minus_a_end_us_min=round(float(jnp.min(gaps)), 2)))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2 * 4864, help="rows of each matrix (default: gate + up, 0.5B)")
    ap.add_argument("--k", type=int, default=896, help="columns (the input width)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--config", action="append", default=None, help="bn,bk,depth (repeatable; default 64,128,8 "
                    "and 32,128,8)")
    ap.add_argument("--programs", type=int, nargs="+", default=None, help="CTA counts to stream with (default: one "
                    "per SM); e.g. 76 132 asks whether 76 SMs (the decode MLP kernel's feature CTAs at the 0.5B "
                    "geometry) reach the bandwidth of all of them")
    ap.add_argument("--launch-cost", action="store_true", help="tiny dependent kernels' cost instead (see above)")
    ap.add_argument("--pdl-overlap", action="store_true", help="whether a Pallas Triton kernel can start under "
                    "the one before it (see above)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench_weight_streaming needs a GPU: Mosaic GPU kernels have no CPU path.", file=sys.stderr)
        return 2
    if args.launch_cost:
        print_rows(launch_cost_rows(), args.json)
        return 0
    if args.pdl_overlap:
        print_rows(pdl_overlap_rows(), args.json)
        return 0
    if args.n % 2:
        raise SystemExit(f"--n {args.n} must be even (the GEMV reads it as gate and up halves)")
    configs = [tuple(int(v) for v in c.split(",")) for c in (args.config or ["64,128,8", "32,128,8"])]
    sms = jax.devices()[0].core_count
    counts = args.programs or [sms]
    if any(not 1 <= c <= sms for c in counts):
        raise SystemExit(f"--programs {counts}: each count must be 1-{sms} (one CTA per SM)")
    programs = counts[0]
    n, k, layers = args.n, args.k, args.layers
    mbytes = n * k * 2 / 1e6
    bandwidth = hbm_bandwidth()
    device = jax.devices()[0].device_kind
    print(f"{device}: {sms} SMs, copy bandwidth {bandwidth / 1e12:.2f} TB/s; {layers} x [{n}, {k}] bf16 "
          f"({mbytes:.1f} MB each)", flush=True)
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    mats = [(0.02 * jax.random.normal(key, (n, k))).astype(jnp.bfloat16) for key in keys]
    stacked = jnp.concatenate(mats, axis=0)
    carry = lambda c=programs: jnp.zeros((carry_size(c),), F32)  # noqa: E731  (time_looped donates it)
    rows = []

    def record(way, config, us, mb=mbytes, ctas=programs):
        tbs = mb / us  # MB per µs = TB/s
        rows.append(dict(device=device, way=way, config=config, ctas=ctas, layers=layers, mb_per_layer=round(mb, 1),
                         us_per_layer=round(us, 2), tb_s=round(tbs, 2),
                         pct_copy_bw=round(100 * tbs * 1e12 / bandwidth)))
        # each figure as it lands: a run cut short by a time limit still reports what it measured
        print(f"  {way} ({config}, {ctas} CTAs): {us:.2f} µs per layer, {tbs:.2f} TB/s", flush=True)

    for (bn, bk, depth), ctas in [(c, p) for c in configs for p in counts]:
        config = f"{bn},{bk},{depth}"
        read = functools.partial(stream_blocks, programs=ctas, bn=bn, bk=bk, depth=depth)
        for way, kw in (("per-matrix kernels", {}), ("per-matrix kernels, PDL", {"pdl": True})):
            def chain(matrices, x, kw=kw, read=read):
                for w in matrices:
                    x = read(w, x, matrices=1, **kw)
                return x
            record(way, config, per_layer_us(chain, mats, carry(ctas), layers), ctas=ctas)
        for way, kw in (("one kernel", {}), ("one kernel, grid barrier per matrix", {"barrier": True})):
            one = functools.partial(read, matrices=layers, **kw)
            record(way, config, per_layer_us(one, stacked, carry(ctas), layers), ctas=ctas)
    bn, bk, depth = configs[0]
    barriers = functools.partial(stream_blocks, matrices=layers, programs=programs, bn=bn, bk=bk, depth=depth,
                                 barrier=True, weights=False)
    record("grid barriers alone", "-", per_layer_us(barriers, stacked, carry(), layers), mb=0.0)
    del stacked

    half = n // 2
    norm_weight = jnp.ones((k,), jnp.bfloat16)
    gate_up = [(w[:half], w[half:]) for w in mats]  # split outside the timed step (a slice inside is a copy)

    def gemv_per_layer(halves, x):
        total = sum(norm_gated_mlp_kernel(x, norm_weight, 1e-5, gate, up, "silu")[0, 0] for gate, up in halves)
        return x + total * 0

    record("decode GEMV (norm + gate/up)", "defaults",
           per_layer_us(gemv_per_layer, gate_up, jnp.ones((1, k), jnp.bfloat16), layers))
    print_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
