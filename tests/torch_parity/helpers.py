"""Shared helpers for the PyTorch parity tests: array conversion, relative error, unwrapping HF fallbacks."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import torch

from apriel2_jax.ops.delta_rule import gated_delta_rule, gated_delta_rule_step, kda_delta_rule, kda_delta_rule_step

TOL = 1e-5
TINY = 1e-30


def to_torch(x) -> torch.Tensor:
    return torch.from_numpy(np.array(x, dtype=np.float32))


def to_jnp(x) -> jnp.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return jnp.asarray(np.asarray(x, dtype=np.float32))


def rel_err(ours, ref) -> float:
    """max|ours - ref| / max(max|ref|, tiny), in float64."""
    ours = np.asarray(ours.detach().numpy() if isinstance(ours, torch.Tensor) else ours, dtype=np.float64)
    ref = np.asarray(ref.detach().numpy() if isinstance(ref, torch.Tensor) else ref, dtype=np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert np.all(np.isfinite(ours)) and np.all(np.isfinite(ref))
    return float(np.max(np.abs(ours - ref)) / max(float(np.max(np.abs(ref))), TINY))


def assert_close(name: str, ours, ref, tol: float = TOL) -> float:
    err = rel_err(ours, ref)
    print(f"[rel_err] {name}: {err:.3e}")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"
    return err


def torch_fallback(fn):
    """The pure-torch body of an HF function wrapped by ``use_kernel_func_from_hub_with_fallback``.

    With fla installed, the module-level name dispatches to fla's Triton kernel (no GPU here), so unwrap it
    and check that what we get is defined in the transformers modeling file itself."""
    raw = inspect.unwrap(fn)
    assert raw.__code__.co_filename == inspect.getfile(inspect.getmodule(fn)), raw.__code__.co_filename
    assert "transformers" in raw.__code__.co_filename
    return raw


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------------------------------------------
# Delta-rule cases shared by the fla and transformers tests. Our ops are jitted once per shape (compilation,
# not execution, dominates the runtime on CPU).

_gdn_seq = jax.jit(gated_delta_rule, static_argnums=6)
_kda_seq = jax.jit(kda_delta_rule, static_argnums=6)
_gdn_step = jax.jit(gated_delta_rule_step)
_kda_step = jax.jit(kda_delta_rule_step)


def delta_inputs(seed: int, T: int, h_k: int, h_v: int, dk: int, dv: int, kda: bool, B: int = 2) -> dict:
    """Raw (un-normalised) q/k, fp32 numpy. GDN: g [B,T,H_v] in [-3, 0]; KDA: g [B,T,H_v,K] in [-5, 0]."""
    r = rng(seed)
    g_shape, g_min = ((B, T, h_v, dk), -5.0) if kda else ((B, T, h_v), -3.0)
    arrays = dict(
        q=r.normal(size=(B, T, h_k, dk)),
        k=r.normal(size=(B, T, h_k, dk)),
        v=r.normal(size=(B, T, h_v, dv)),
        g=r.uniform(g_min, 0.0, size=g_shape),
        beta=r.uniform(0.05, 1.0, size=(B, T, h_v)),
        s0=0.5 * r.normal(size=(B, h_v, dk, dv)),
    )
    return {n: x.astype(np.float32) for n, x in arrays.items()}


def ours_seq(inp: dict, chunk: int, kda: bool):
    j = {n: jnp.asarray(x) for n, x in inp.items()}
    fn = _kda_seq if kda else _gdn_seq
    return fn(j["q"], j["k"], j["v"], j["g"], j["beta"], j["s0"], chunk)


def ours_steps(inp: dict, kda: bool):
    """Token by token through the one-step op."""
    j = {n: jnp.asarray(x) for n, x in inp.items()}
    fn = _kda_step if kda else _gdn_step
    state, outs = j["s0"], []
    for t in range(j["q"].shape[1]):
        o, state = fn(j["q"][:, t], j["k"][:, t], j["v"][:, t], j["g"][:, t], j["beta"][:, t], state)
        outs.append(o)
    return jnp.stack(outs, axis=1), state


def torch_inputs(inp: dict, normalise: bool, expand: bool) -> dict:
    """Torch tensors. normalise: L2-normalise q/k as fla's in-kernel norm does (x / sqrt(|x|^2 + 1e-6)), for
    references that take normalised q/k; expand: repeat_interleave key heads up to the value heads."""
    t = {n: to_torch(x) for n, x in inp.items()}
    for n in ("q", "k"):
        if normalise:
            t[n] = t[n] / torch.sqrt((t[n] * t[n]).sum(-1, keepdim=True) + 1e-6)
        if expand:
            t[n] = t[n].repeat_interleave(t["v"].shape[2] // t[n].shape[2], dim=2)
    return t
