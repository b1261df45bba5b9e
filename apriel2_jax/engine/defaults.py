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
    # Decode tokens per dispatch: each dispatch carries a fixed cost (launch, inputs, the results' transfer and
    # the host's token bookkeeping; ~1-2 ms by the step times at 8 and 16), so more steps per dispatch shorten
    # every step; more also delay admissions and leave rows that stopped early idle until the dispatch ends.
    # 16 against 8 took the 0.5B decode step down 6-10% on three of four placements (H200, docs/BENCHMARKS.md).
    decode_steps: int = 16
    # Queue the next decode dispatch before reading the current one's results while no request can join the
    # decode batch, so the host's launch and token bookkeeping overlap the device's work (``LLM``, ``chain_decode``).
    chain_decode: bool = True
    # Queue the next prefill step before reading the current one's results while no request decodes (a batch of
    # prompts arriving together), so the host's scheduling, inputs and launch overlap the device's prefill
    # (``LLM``, ``chain_prefill``).
    chain_prefill: bool = True
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
