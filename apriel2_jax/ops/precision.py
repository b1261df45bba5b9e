"""The matmul precision of a model's dtype: a float32 model computes its products in float32.

XLA's default precision lets a GPU run float32 dots in TF32 (10-bit mantissas). On an H200 that moved a float32
model's logits by up to ~1e-3 of their scale (0.01-0.04 at scales of 10-40), more than the goldens' smallest
top-two gap (~0.01) and the parity checks' 1e-3 budget. The model's matmuls therefore ask for ``HIGHEST`` where
their operands are float32, whatever the caller's ``jax_default_matmul_precision``; other dtypes keep XLA's
default (their dots run on the tensor cores in the dtype, accumulating in float32). On the CPU both give the same
results."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_precision(*operands: jax.Array) -> jax.lax.Precision | None:
    """``HIGHEST`` if every operand is float32, else None (XLA's default)."""
    if all(jnp.dtype(x.dtype) == jnp.float32 for x in operands):
        return jax.lax.Precision.HIGHEST
    return None


def einsum(spec: str, *operands: jax.Array) -> jax.Array:
    """``jnp.einsum`` at the operands' ``matmul_precision``."""
    return jnp.einsum(spec, *operands, precision=matmul_precision(*operands))
