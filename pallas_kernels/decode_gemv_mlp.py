"""The gated MLP of one decode row with its norm and residual add (``x + down(act(gate(rmsnorm(x))) *
up(rmsnorm(x)))``) as one Triton kernel: the decode GEMV kernels' gate/up programs and down programs in one grid,
the down programs waiting on a counter in memory for the product instead of on a kernel boundary. The jnp oracle
is ``apriel2_jax.ops.decode_fused.gated_mlp_residual``.

Why. At one row the MLP is two weight-streaming kernels (``decode_gemv``'s ``norm_gated_mlp`` and ``matmul_add``),
and the second one's launch, dependence on the first and first weight loads come after the first one's last
program (~2 µs per kernel boundary, docs/BENCHMARKS.md). Here the down programs issue their weight loads as they
start and only their products wait for the counter.

Design. Programs ``[0, G)`` are the gate/up GEMV tiles (``decode_gemv._gemv`` with the norm), programs ``[G, G +
D)`` the down GEMV tiles with the residual add, in one grid. A gate/up program stores its product tile, then
(after a barrier of its threads, so every thread's stores precede it) adds one to ``sync[0]`` (an acquire-release
atomic at GPU scope). A down program loads its residual and all of its weight tiles, polls ``sync[0]`` until
it reaches ``G`` (volatile loads, then one acquire-release atomic read, which orders the product's loads after
it for the whole program: the scalar atomic ends in a barrier of its threads), then loads the product and
multiplies. Its last act adds one to ``sync[1]``; the program that brings it to ``D`` sets both
counters back to zero, so the buffer leaves the kernel as it came in (zeros).

No deadlock on the GPU needs a down program never to hold an SM that a gate/up program it waits for has not yet
started on: the hardware starts a grid's programs in increasing order (the order decoupled look-back scans rely
on), and every down program comes after every gate/up program.

Status: measured, not registered (``scripts/bench_decode_mlp.py --dataflow``; docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from apriel2_jax import dispatch
from apriel2_jax.ops.norms import _ACTIVATIONS

from . import decode_gemv

F32 = jnp.float32
KERNEL_ROWS = 1
BLOCK_N = 4  # output features per program of both phases (the GEMV kernels' tiles)


def unsupported_reason(x, norm_weight, w_gate, w_up, w_down, act) -> str | None:
    """Why the kernel cannot take these arguments (None where it can)."""
    reason = decode_gemv.norm_gated_mlp_unsupported(x, norm_weight, 0.0, w_gate, w_up, act)
    if reason is not None:
        return reason
    rows, hidden = x.shape
    if rows > KERNEL_ROWS:
        return f"at most {KERNEL_ROWS} rows (got {rows})"
    inter = w_gate.shape[0]
    if w_down.shape != (hidden, inter) or w_down.dtype != x.dtype:
        return f"down weight must be [{hidden}, {inter}] {x.dtype} (got {w_down.shape} {w_down.dtype})"
    if inter % BLOCK_N or hidden % BLOCK_N:
        return f"widths {hidden} and {inter} must be multiples of {BLOCK_N}"
    if decode_gemv._chunk(inter, None) is None:
        return f"intermediate width {inter} must be a multiple of 16"
    return None


def _kernel(x_ref, nw_ref, wg_ref, wu_ref, wd_ref, sync_in_ref, h_ref, o_ref, sync_ref, *, eps, act, rows, hidden,
            inter, gu_chunk, d_chunk, depth, gu_programs, d_programs, barrier, preload):
    del sync_in_ref  # the same buffer as sync_ref (aliased)
    program = pl.program_id(0)
    dtype = o_ref.dtype
    _I0, _I1 = jnp.int32(0), jnp.int32(1)  # the counters' indices (Pallas's atomics take array indices)

    @pl.when(program < gu_programs)
    def _gate_up():
        cols = pl.ds(program * BLOCK_N, BLOCK_N)
        accs = decode_gemv._gemv(x_ref, [(wg_ref, cols), (wu_ref, cols)], rows=rows, k_dim=hidden, chunk=gu_chunk,
                                 depth=depth, norm=(eps, nw_ref))
        for r in range(rows):
            gate, up = accs[r]
            activated = _ACTIVATIONS[act](gate.astype(dtype).astype(F32)).astype(dtype)
            h_ref[r, cols] = (activated.astype(F32) * up.astype(dtype).astype(F32)).astype(dtype)
        if barrier:  # every thread's stores before the count that releases them (the interpreter runs no threads)
            pltriton.debug_barrier()
        pltriton.atomic_add(sync_ref, _I0, jnp.int32(1))

    @pl.when(program >= gu_programs)
    def _down():
        tile = program - gu_programs
        cols = pl.ds(tile * BLOCK_N, BLOCK_N)
        residuals = [x_ref[r, cols] for r in range(rows)]
        chunks = inter // d_chunk
        if preload:  # every weight tile's load issued before the wait
            tiles = [decode_gemv._load_weights(wd_ref, cols, pl.ds(c * d_chunk, d_chunk)) for c in range(chunks)]

        def waiting(seen):
            return seen < gu_programs

        def poll(_):
            return pltriton.load(sync_ref.at[0], volatile=True)

        lax.while_loop(waiting, poll, pltriton.load(sync_ref.at[0], volatile=True))
        pltriton.atomic_add(sync_ref, _I0, jnp.int32(0))  # acquire: the products' stores are visible after it
        if preload:
            accs = [None] * rows
            for c in range(chunks):
                for r in range(rows):
                    h = h_ref[r, pl.ds(c * d_chunk, d_chunk)]
                    product = tiles[c].astype(F32) * h.astype(F32)[None, :]
                    accs[r] = product if accs[r] is None else accs[r] + product
            sums = [jnp.sum(acc, axis=1) for acc in accs]
        else:  # the down GEMV kernel's loop from here
            sums = [acc[0] for acc in decode_gemv._gemv(h_ref, [(wd_ref, cols)], rows=rows, k_dim=inter,
                                                        chunk=d_chunk, depth=4)]
        for r in range(rows):
            out = residuals[r].astype(F32) + sums[r].astype(dtype).astype(F32)
            o_ref[r, cols] = out.astype(dtype)
        if barrier:
            pltriton.debug_barrier()
        done = pltriton.atomic_add(sync_ref, _I1, jnp.int32(1))

        @pl.when(done == d_programs - 1)
        def _reset():  # every program has counted and passed its wait: the buffer goes back to zeros
            pltriton.atomic_add(sync_ref, _I0, jnp.int32(-gu_programs))
            pltriton.atomic_add(sync_ref, _I1, jnp.int32(-d_programs))


@functools.partial(jax.jit, static_argnames=("eps", "act", "depth", "preload", "num_warps", "interpret"),
                   donate_argnames=("sync",))
def gated_mlp_residual_kernel(x, norm_weight, eps, w_gate, w_up, w_down, act, sync, *, depth: int = 8,
                              preload: bool = True, num_warps: int = 4, interpret: bool = False):
    """``(x + down(act(gate(rmsnorm(x))) * up(rmsnorm(x))), sync)``; ``sync``: int32 [2] of zeros, returned as
    zeros (thread it from one call to the next, or pass fresh zeros)."""
    reason = unsupported_reason(x, norm_weight, w_gate, w_up, w_down, act)
    if reason is not None:
        raise ValueError(f"gated_mlp_residual: {reason}")
    if sync.shape != (2,) or sync.dtype != jnp.int32:
        raise ValueError(f"gated_mlp_residual: sync must be int32 [2] (got {sync.shape} {sync.dtype})")
    rows, hidden = x.shape
    inter = w_gate.shape[0]
    gu_programs, d_programs = inter // BLOCK_N, hidden // BLOCK_N
    kernel = functools.partial(_kernel, eps=eps, act=act, rows=rows, hidden=hidden, inter=inter,
                               gu_chunk=decode_gemv._chunk(hidden, None), d_chunk=decode_gemv._chunk(inter, None),
                               depth=depth, gu_programs=gu_programs, d_programs=d_programs,
                               barrier=not interpret, preload=preload)
    _, out, sync = pl.pallas_call(
        kernel,
        grid=(gu_programs + d_programs,),
        out_shape=(jax.ShapeDtypeStruct((rows, inter), x.dtype), jax.ShapeDtypeStruct((rows, hidden), x.dtype),
                   jax.ShapeDtypeStruct((2,), jnp.int32)),
        input_output_aliases={5: 2},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"gemv_mlp_dataflow_k{hidden}",
    )(x, norm_weight, w_gate, w_up, w_down, sync)
    return out, sync


def gated_mlp_residual(x, norm_weight, eps, w_gate, w_up, w_down, act):
    """Entry with the op's signature (``ops.decode_fused.gated_mlp_residual``): the kernel at one row with a fresh
    counter buffer; elsewhere the dispatched ``norm_gated_mlp`` and ``matmul_add`` (the engine's path without
    this op)."""
    if unsupported_reason(x, norm_weight, w_gate, w_up, w_down, act) is not None:
        product = dispatch.op("norm_gated_mlp")(x, norm_weight, eps, w_gate, w_up, act)
        return dispatch.op("matmul_add")(product, w_down, x)
    out, _ = gated_mlp_residual_kernel(x, norm_weight, float(eps), w_gate, w_up, w_down, act,
                                       jnp.zeros((2,), jnp.int32))
    return out
