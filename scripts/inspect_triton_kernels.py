#!/usr/bin/env python3
"""The decode step's Pallas Triton kernels compiled for Hopper on a machine without a GPU: what Triton made of them.

    python3 scripts/inspect_triton_kernels.py [--rows 1] [--kernels gate_up down qkv o_proj attention]
                                              [--set gate_up:depth=1 ...] [--out DIR]

Each kernel is lowered as the engine calls it at the 0.5B geometry (cross-lowered for CUDA on an abstract H200:
its TTIR, the Pallas lowering's output), compiled for sm_90 by the ``triton`` package (with its own ptxas,
nvdisasm and cuobjdump; ``pip install -e '.[test]'`` pins it) with the launch's ``num_warps`` and
``num_stages``, and summarised: layout conversions in the TTGIR (each a round trip through shared memory),
barriers, shared-memory loads and stores and instructions in the SASS, registers per thread. With ``--out`` the TTIR,
TTGIR, PTX and SASS of each kernel are written there. ``--set KERNEL:KEY=VALUE`` passes a keyword (an integer or a
word) to a kernel's function (e.g. ``gate_up:depth=1``, ``down:block_n=8``, ``attention:splits=4``,
``attention:page_ids=vector``), so variants compare without a GPU.

XLA compiles the same TTIR with its own Triton, so absolute figures differ from the GPU's: at the 0.5B geometry
and one row, registers per thread on an H200 (Nsight Compute, 2026-11-29) against this compiler's: gate/up 60
against 48, down 48 against 64, Q/K/V 48 against 56, the output projection 32 against 29. Compare variants with
each other here and confirm on the GPU (``scripts/profile_decode_kernels.py`` under Nsight Compute). The TTIR is
taken from JAX's Pallas Triton lowering through an internal function (jax 0.11.2).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from apriel2_jax.benchmarking import engine_table_pages  # noqa: E402
from pallas_kernels import decode_gemv  # noqa: E402
from pallas_kernels.paged_attention_decode import rope_write_paged_attention_decode  # noqa: E402

KERNELS = ("gate_up", "down", "qkv", "o_proj", "attention")
_ABSTRACT_H200 = dict(device_kind="NVIDIA H200", platform="gpu", num_cores=132)


def kernel_cases(rows: int, hidden=896, intermediate=4864, heads=14, groups=2, head_dim=64, context=1024,
                 page_size=16, options=None):
    """name -> (function of abstract arguments, the arguments) for the decode kernels at ``rows`` rows;
    ``options[name]`` holds extra keyword arguments of that kernel's function."""
    options = options or {}
    bf16, i32 = jnp.bfloat16, jnp.int32

    def spec(*shape, dtype=bf16):
        return jax.ShapeDtypeStruct(shape, dtype)

    q_width, kv_width = heads * head_dim, groups * head_dim
    width = engine_table_pages(context, 128, page_size)
    pages = rows * width + 1
    opts = {name: options.get(name, {}) for name in KERNELS}
    return {
        "gate_up": (lambda x, n, g, u: decode_gemv.norm_gated_mlp_kernel(x, n, 1e-5, g, u, "silu", **opts["gate_up"]),
                    (spec(rows, hidden), spec(hidden), spec(intermediate, hidden), spec(intermediate, hidden))),
        "down": (lambda x, w, r: decode_gemv.matmul_add_kernel(x, w, r, **opts["down"]),
                 (spec(rows, intermediate), spec(hidden, intermediate), spec(rows, hidden))),
        "qkv": (lambda x, n, q, k, v: decode_gemv.norm_projections_kernel(x, n, 1e-5, (q, k, v), **opts["qkv"]),
                (spec(rows, hidden), spec(hidden), spec(q_width, hidden), spec(kv_width, hidden),
                 spec(kv_width, hidden))),
        "o_proj": (lambda x, w, r: decode_gemv.matmul_add_kernel(x, w, r, **opts["o_proj"]),
                   (spec(rows, q_width), spec(hidden, q_width), spec(rows, hidden))),
        "attention": (lambda q, c, s, sl, kp, vp, t, f, p: rope_write_paged_attention_decode(
            q, None, None, c, s, sl, kp, vp, t, f, p, **opts["attention"]),
            (spec(rows, heads + 2 * groups, head_dim), spec(rows, head_dim), spec(rows, head_dim),
             spec(rows, dtype=i32), spec(pages, page_size, groups, head_dim), spec(pages, page_size, groups, head_dim),
             spec(rows, width, dtype=i32), spec(rows, dtype=i32), spec(rows, 1, dtype=i32))),
    }


@contextlib.contextmanager
def _capturing_triton_modules(modules: list):
    from jax._src.pallas.triton import pallas_call_registration as registration

    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower


def triton_modules(fn, args) -> list[dict]:
    """The Triton kernels ``fn(*args)`` lowers to for CUDA, in launch order: name, TTIR text, num_warps and
    num_stages (from the custom calls' configurations)."""
    modules: list[str] = []
    jax.clear_caches()  # a cached lowering would skip the Pallas lowering this captures
    device = jax.sharding.AbstractDevice(**_ABSTRACT_H200)
    with _capturing_triton_modules(modules), \
            jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    launches = {m[1]: (int(m[3]), int(m[2])) for m in
                re.finditer(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', hlo)}
    if not modules:
        raise RuntimeError("the function lowered to no Pallas Triton kernel")
    kernels = []
    for text in modules:
        name = re.search(r"module @(\S+)", text)[1]
        if name not in launches:
            raise RuntimeError(f"no launch configuration found for Triton kernel {name!r} in the lowered HLO")
        num_warps, num_stages = launches[name]
        kernels.append(dict(name=name, ttir=text, num_warps=num_warps, num_stages=num_stages))
    return kernels


def compile_sm90(kernel: dict) -> dict:
    """The kernel compiled by the ``triton`` package for sm_90: its TTGIR, PTX and SASS, and the summary."""
    import triton
    from triton.backends.compiler import GPUTarget

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ttir = os.path.join(tmp, kernel["name"] + ".ttir")
        with open(ttir, "w") as f:
            f.write(kernel["ttir"])
        compiled = triton.compile(ttir, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=kernel["num_warps"], num_stages=kernel["num_stages"]))
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
    ttgir = compiled.asm["ttgir"]
    instructions = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(\S+(?: \S+)?)", sass)
    opcodes = [ins.split()[-1] if ins.startswith("@") else ins.split()[0] for ins in instructions]

    def count(prefix):
        return sum(op == prefix or op.startswith(prefix + ".") for op in opcodes)

    registers = re.search(r"REG:(\d+)", usage)
    summary = dict(kernel=kernel["name"], warps=kernel["num_warps"], stages=kernel["num_stages"],
                   registers=int(registers[1]) if registers else None,
                   layout_conversions=ttgir.count("ttg.convert_layout"), barriers=count("BAR"),
                   shared_loads=count("LDS") + count("LDSM"), shared_stores=count("STS") + count("STSM"),
                   instructions=len(opcodes))
    return dict(summary=summary, ttgir=ttgir, ptx=compiled.asm["ptx"], sass=sass)


def _parse_set(items) -> dict:
    options: dict = {}
    for item in items:
        match = re.fullmatch(r"(\w+):(\w+)=([\w-]+)", item)
        if not match or match[1] not in KERNELS:
            raise SystemExit(f"--set {item!r}: expected KERNEL:KEY=VALUE with KERNEL one of {', '.join(KERNELS)}")
        value = match[3]
        options.setdefault(match[1], {})[match[2]] = int(value) if re.fullmatch(r"-?\d+", value) else value
    return options


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1,
                    help="decode rows (the engine runs the GEMV kernels at 1-2 rows, gate/up at 1)")
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    ap.add_argument("--set", nargs="*", default=[], metavar="KERNEL:KEY=VALUE",
                    help="a keyword argument of a kernel's function (an integer, or a word), e.g. gate_up:depth=1, "
                         "attention:page_ids=vector")
    ap.add_argument("--out", help="directory for each kernel's TTIR, TTGIR, PTX and SASS")
    args = ap.parse_args(argv)
    if args.rows < 1:
        raise SystemExit(f"--rows {args.rows}: must be at least 1")
    options = _parse_set(args.set)
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("inspect_triton_kernels needs the triton package: pip install -e '.[test]' (it pins "
                         "triton==3.6.0)")
    cases = kernel_cases(args.rows, options=options)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    print(f"{'case':<10} {'kernel':<56} {'warps':>5} {'stages':>6} {'regs':>4} {'conversions':>11} {'BAR':>4} "
          f"{'LDS':>4} {'STS':>4} {'SASS':>5}")
    for case in args.kernels:
        fn, fn_args = cases[case]
        for kernel in triton_modules(fn, fn_args):
            result = compile_sm90(kernel)
            s = result["summary"]
            registers = "-" if s["registers"] is None else s["registers"]
            print(f"{case:<10} {s['kernel']:<56} {s['warps']:>5} {s['stages']:>6} {registers:>4} "
                  f"{s['layout_conversions']:>11} {s['barriers']:>4} {s['shared_loads']:>4} {s['shared_stores']:>4} "
                  f"{s['instructions']:>5}")
            if args.out:
                for ext, text in (("ttir", kernel["ttir"]), ("ttgir", result["ttgir"]), ("ptx", result["ptx"]),
                                  ("sass", result["sass"])):
                    with open(os.path.join(args.out, f"{case}_{s['kernel']}.{ext}"), "w") as f:
                        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
