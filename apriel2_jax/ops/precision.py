"""The matmul precision of a model's dtype: a float32 model computes its products in float32.

XLA's default precision lets a GPU run float32 dots in TF32 (10-bit mantissas). On an H200, two such forwards of
the same tokens (padded and exact length, random small geometries) differed by 0.009-0.039 at logit scales of
10-40: 10-40 times the parity checks' absolute 1e-3 budget, and more than the goldens' smallest top-two gap
(~0.01). The model's matmuls therefore ask for ``HIGHEST`` where their operands are float32, whatever the caller's
``jax_default_matmul_precision``. Dots of other dtypes keep the caller's default (a bfloat16 model's run on the
tensor cores in bfloat16, accumulating in float32); the model has no dot of mixed dtypes. On the CPU both give
the same results."""

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
