"""Serving defaults shared by ``LLM`` and the ``apriel2-generate`` CLI (no JAX import: the CLI reads them
before it loads anything)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineDefaults:
    """Serving defaults shared by ``LLM`` and the CLI: sized for throughput on one GPU, like vLLM's (a token
    budget of 8192 per step and no separate cap on the rows of a prefill step)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    page_size: int = 16
    decode_steps: int = 8
    cache_memory_fraction: float = 0.85
    warm_up: str = "few"
    prefix_caching: bool = True
    snapshot_memory_fraction: float = 0.1  # of the cache budget, for prefix-cache recurrent-state snapshots
    # Tokens: prefill chunks of recurrent placements also end at its multiples (0: off). Off by default: with
    # smaller chunks more requests share a prefill step, so requests that share a not-yet-computed prefix
    # compute it side by side (measured on H200: 88% instead of 91% of a 64 x 4K shared prefix reused).
    snapshot_interval: int = 0
    kv_load_timeout: float = 30.0  # seconds: an external-connector load taking longer is recomputed instead


DEFAULTS = EngineDefaults()
WARM_UP_CHOICES = ("none", "few", "all")
