"""The jitted engine step: one compiled function per shape bucket (rows, tokens per row) and placement.

The host turns a ``ScheduledStep`` into fixed-shape numpy arrays once per step (``build_inputs``); the device
runs the model over the paged caches, donated and updated in place, and samples each row's next token. Padding
rows and tokens touch only the sink page and sink slot, so a bucket larger than the live requests (or the state
slots) never indexes out of bounds.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..modules import Apriel2ForCausalLM
from ..modules.paged import PagedBatch
from ..placement import Placement
from .cache_manager import CacheManager
from .sampling import keys_from_words, sample, seeds_to_words
from .scheduler import ScheduledStep


def _powers_of_two_upto(limit: int, start: int = 1) -> tuple[int, ...]:
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (limit,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    decode_rows: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    prefill_tokens: tuple[int, ...]

    @classmethod
    def default(cls, max_num_seqs: int, max_prefill_rows: int, max_chunk: int) -> "Buckets":
        return cls(
            _powers_of_two_upto(max_num_seqs),
            _powers_of_two_upto(max_prefill_rows),
            _powers_of_two_upto(max_chunk, start=min(16, max_chunk)),
        )

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, tokens) shape the engine can run: what start-up compiles."""
        return [(r, 1) for r in self.decode_rows] + [(r, t) for r in self.prefill_rows for t in self.prefill_tokens]

    def pick(self, kind: str, rows: int, tokens: int) -> tuple[int, int]:
        def smallest(options, n):
            i = bisect.bisect_left(options, n)
            if i == len(options):
                raise ValueError(f"no bucket holds {n} (buckets {options})")
            return options[i]

        if kind == "decode":
            return smallest(self.decode_rows, rows), 1
        return smallest(self.prefill_rows, rows), smallest(self.prefill_tokens, tokens)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    tokens: np.ndarray  # [S, T]
    batch: PagedBatch  # numpy leaves
    temperature: np.ndarray  # [S]
    top_k: np.ndarray  # [S]
    top_p: np.ndarray  # [S]
    seeds: np.ndarray  # [S, 2] uint32 words of each request's 64-bit seed
    counters: np.ndarray  # [S] uint32 number of tokens the request has generated so far


def build_inputs(step: ScheduledStep, shape: tuple[int, int], cache: CacheManager) -> StepInputs:
    rows, width = shape
    tokens = np.zeros((rows, width), np.int32)
    positions = np.zeros((rows, width), np.int32)
    mask = np.zeros((rows, width), bool)
    last = np.zeros((rows,), np.int32)
    fresh = np.zeros((rows,), bool)
    temperature = np.zeros((rows,), np.float32)
    top_k = np.zeros((rows,), np.int32)
    top_p = np.ones((rows,), np.float32)
    seeds = np.zeros((rows, 2), np.uint32)
    counters = np.zeros((rows,), np.uint32)
    for i, row in enumerate(step.rows):
        request = row.request
        tokens[i, : row.length] = [request.token(p) for p in range(row.start, row.start + row.length)]
        positions[i] = np.arange(row.start, row.start + width)
        mask[i, : row.length] = True
        last[i] = row.length - 1
        fresh[i] = row.start == 0
        params = request.params
        temperature[i] = params.temperature
        top_k[i] = params.top_k
        top_p[i] = params.top_p
        seeds[i] = seeds_to_words([request.seed])[0]
        counters[i] = len(request.output_ids)
    tables = cache.build_step_tables([row.request.request_id for row in step.rows], rows)
    batch = PagedBatch(positions, mask, last, tables.slots, fresh, tables.tables, tables.first_page)
    return StepInputs(tokens, batch, temperature, top_k, top_p, seeds, counters)


class StepRunner:
    """Owns the model parameters and the jitted step; counts compilations (each trace is one)."""

    def __init__(self, model: Apriel2ForCausalLM):
        self.graphdef, self.params = nnx.split(model)
        self.compilations = 0
        self._step = jax.jit(self._step_fn, static_argnames=("placement",), donate_argnames=("cache",))

    def _step_fn(self, params, cache, tokens, batch, temperature, top_k, top_p, seeds, counters, placement):
        self.compilations += 1  # Python runs here only while tracing, i.e. once per compiled shape
        model = nnx.merge(self.graphdef, params)
        logits, cache = model.forward_paged(tokens, batch, cache, placement)
        keys = keys_from_words(seeds, counters)
        next_tokens, logprobs = sample(logits.astype(jnp.float32), temperature, top_k, top_p, keys)
        return next_tokens, logprobs, cache

    def run(self, cache, inputs: StepInputs, placement: Placement):
        """Returns (next tokens [S], logprobs [S]) as device arrays and the updated cache."""
        return self._step(
            self.params,
            cache,
            inputs.tokens,
            inputs.batch,
            inputs.temperature,
            inputs.top_k,
            inputs.top_p,
            inputs.seeds,
            inputs.counters,
            placement=placement,
        )

    def warm_up(
        self,
        cache,
        shapes: Sequence[tuple[int, int]],
        cache_manager: CacheManager,
        placement: Placement,
        progress: Callable[[str], None] | None = None,
    ):
        """Compile every bucket now (padding-only inputs: all rows hit the sink), so serving never compiles."""
        empty = ScheduledStep("prefill", (), ())
        start = time.monotonic()
        for i, shape in enumerate(shapes, start=1):
            inputs = build_inputs(empty, shape, cache_manager)
            _, _, cache = self.run(cache, inputs, placement)
            if progress is not None:
                progress(f"compiling step {i}/{len(shapes)} (rows={shape[0]}, tokens={shape[1]}) "
                         f"{time.monotonic() - start:.0f}s")
        return cache
