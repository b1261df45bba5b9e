"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def hbm_bandwidth(repeats: int = 10) -> float:
    """Device memory bandwidth in bytes/s: an elementwise op over 4 GiB of fp32 (4 GiB read, 4 GiB written),
    median time after one warm-up run."""
    x = jnp.ones((2**30,), jnp.float32)
    scale = jax.jit(lambda a: a * 1.0001)
    scale(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        scale(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / statistics.median(times)
