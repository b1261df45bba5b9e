"""The one dispatch point between the jnp reference ops and the Pallas kernels.

Modules never import an op implementation directly; they call ``op("name")`` at trace time. Kernels register
themselves for a platform (``register("gated_delta_rule", "gpu", fn)``) with the same signature as the jnp
reference. ``APRIEL2_OPS=reference`` forces the jnp ops everywhere (the oracle, and the CPU path).
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import jax
import numpy as np

from .ops import attention, conv, decode_fused, delta_rule, mamba, paged_attention

_REFERENCE: dict[str, Callable] = {
    "attention": attention.attention,
    "causal_conv1d": conv.causal_conv1d,
    "causal_conv1d_step": conv.causal_conv1d_step,
    "causal_conv1d_varlen_slots": conv.causal_conv1d_varlen_slots,
    "causal_conv1d_decode_slots": conv.causal_conv1d_decode_slots,
    "gated_delta_rule": delta_rule.gated_delta_rule,
    "gated_delta_rule_step": delta_rule.gated_delta_rule_step,
    "kda_delta_rule": delta_rule.kda_delta_rule,
    "kda_delta_rule_step": delta_rule.kda_delta_rule_step,
    "selective_scan": mamba.selective_scan,
    "selective_scan_step": mamba.selective_scan_step,
    "selective_scan_varlen_slots": mamba.selective_scan_varlen_slots,
    "selective_scan_decode_slots": mamba.selective_scan_decode_slots,
    "paged_attention": paged_attention.paged_attention,
    "rope_write_paged_attention": paged_attention.rope_write_paged_attention,
    "delta_rule_decode_slots": delta_rule.delta_rule_decode_slots,
    "delta_rule_decode_slots_packed": delta_rule.delta_rule_decode_slots_packed,
    "gdn_decode_gated_slots": delta_rule.gdn_decode_gated_slots,
    "kda_decode_conv_gated_slots": delta_rule.kda_decode_conv_gated_slots,
    "delta_rule_varlen_slots": delta_rule.delta_rule_varlen_slots,
    "gdn_decode_fused_slots": delta_rule.gdn_decode_fused_slots,
    "kda_decode_fused_slots": delta_rule.kda_decode_fused_slots,
    "norm_projections": decode_fused.norm_projections,
    "norm_projections_conv": decode_fused.norm_projections_conv,
    "norm_gated_mlp": decode_fused.norm_gated_mlp,
    "matmul_add": decode_fused.matmul_add,
    "gated_mlp_residual": decode_fused.gated_mlp_residual,
}
_KERNELS: dict[tuple[str, str], Callable] = {}


def lowered_once(fn: Callable) -> Callable:
    """``fn`` behind one ``jax.jit`` per call signature (its pytree structure, array shapes and non-array
    arguments), so a kernel called at many sites of one step (every layer) is traced and lowered once.

    Lowering a Pallas kernel (building its Triton or Mosaic GPU module) runs per call site otherwise, and the
    persistent compilation cache cannot skip it: the cache key is the lowered module. A Mosaic GPU kernel took
    ~0.5 s to lower per site on a development machine's CPU (8 sites: 4.4 s, against 0.45 s behind one jit).
    XLA inlines the nested call, so the compiled step is the same. Arguments that are not arrays must be
    hashable; a call with one that is not goes to ``fn`` directly."""
    jitted: dict = {}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]
        # The type too: 1, 1.0 and True are equal but trace differently.
        statics = tuple((i, type(leaf), leaf) for i, (leaf, array) in enumerate(zip(leaves, is_array)) if not array)
        key = (tree, statics, tuple(is_array))
        try:
            inner = jitted.get(key)
        except TypeError:  # an unhashable non-array argument
            return fn(*args, **kwargs)
        if inner is None:
            def run(*array_args, tree=tree, statics=statics, is_array=tuple(is_array)):
                full, it = [None] * len(is_array), iter(array_args)
                for i, array in enumerate(is_array):
                    if array:
                        full[i] = next(it)
                for i, _, leaf in statics:
                    full[i] = leaf
                call_args, call_kwargs = jax.tree.unflatten(tree, full)
                return fn(*call_args, **call_kwargs)

            inner = jitted[key] = jax.jit(run)
        return inner(*(leaf for leaf, array in zip(leaves, is_array) if array))

    return call


def register(name: str, platform: str, fn: Callable) -> None:
    """Register a kernel for ``name`` on ``platform`` ("gpu", "cpu", ...); it must match the reference signature.
    It runs behind :func:`lowered_once`."""
    if name not in _REFERENCE:
        raise KeyError(f"unknown op {name!r}; known ops: {sorted(_REFERENCE)}")
    _KERNELS[(name, platform)] = lowered_once(fn)


def unregister(name: str, platform: str | None = None) -> None:
    """Drop the kernel for ``name`` on ``platform`` (default: the default backend), so its callers take the
    reference (or, for fused ops, the unfused chain): benchmarks use it for side-by-side baselines."""
    kernel(name)  # imports the GPU kernels first, so a later import cannot register it again
    _KERNELS.pop((name, platform or jax.default_backend()), None)


_kernels_imported = False


def kernel(name: str) -> Callable | None:
    """The kernel registered for ``name`` on the default backend, or None (always None under
    ``APRIEL2_OPS=reference``). For fused ops whose unfused path is itself a chain of dispatched ops."""
    global _kernels_imported
    if name not in _REFERENCE:
        raise KeyError(f"unknown op {name!r}; known ops: {sorted(_REFERENCE)}")
    if os.environ.get("APRIEL2_OPS", "") == "reference":
        return None
    backend = jax.default_backend()
    if backend != "cpu" and not _kernels_imported:
        import pallas_kernels  # noqa: F401  (registers the GPU kernels; a failed import raises, every time)

        _kernels_imported = True
    return _KERNELS.get((name, backend))


def op(name: str) -> Callable:
    """The implementation of ``name`` for the default backend: a registered kernel, else the jnp reference."""
    fn = kernel(name)
    return _REFERENCE[name] if fn is None else fn
