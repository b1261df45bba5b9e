"""``LLM``: the Python API of the serving engine.

    llm = LLM("path/to/checkpoint", dtype="bfloat16", max_num_seqs=32)
    outputs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0.7, max_new_tokens=64))
    for event in llm.stream(prompts, params): ...

One engine loop: the scheduler picks a step, the host builds its inputs once, the jitted step runs and samples,
and the host appends tokens and checks stop conditions. Device caches are allocated once per placement from a
memory budget and donated to every step.

While no request can join the decode batch (none waits, none is being prefilled or loaded) and every row runs
whole dispatches with stop conditions the device checks exactly, the next decode dispatch is *chained*:
queued before the host reads the current one, taking each row's last token from it on the device (a row that
stops there runs as padding, and leaves the batch at the dispatch after). The host then reads and appends a
dispatch's tokens while the device runs the next, and the device never waits for the host between them.

Prefill steps chain the same way while no request decodes (``chain_prefill``): a prefill step's tokens count as
cached once it is queued (``Scheduler.complete``), so the next prefill step is scheduled and queued before the
host reads the current one (``Scheduler.schedule_ahead``). The rows it samples from have nothing pending until
their tokens are read, so no step feeds them before that.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..checkpoint import load_model
from ..compilation_cache import enable_compilation_cache
from ..config import StochasticConfig
from ..distributed import agree_on_minimum
from ..modules import Apriel2ForCausalLM
from ..placement import PlacementSpec, load_placements, resolve_placement
from ..sharding import ShardingError
from ..tensor_parallel import ShardedModel, shard_model
from .cache_layout import CacheConfigError, cache_layout, plan_cache
from .cache_manager import CacheManager
from .defaults import DEFAULTS, WARM_UP_CHOICES
from .kv_connector import ConnectorStats, Entry, EntryStore, KVConnector, LoadResult
from .kv_connector import transfer
from .prefix_cache import QUEUE_LOOKAHEAD, PrefixCache, PrefixStats, prefix_root
from .sampling import SamplingParams, StopChecker, request_seed
from .scheduler import Request, RequestStatus, ScheduledRow, ScheduledStep, Scheduler, SchedulerConfig
from .step import Buckets, StepRunner, build_inputs, device_stops_exactly, stop_check_group, unpack_outputs
from .tokenizer import TOKENIZER_FILE, Tokenizer

DEFAULT_CPU_CACHE_BYTES = 256 * 2**20


@dataclasses.dataclass
class RequestOutput:
    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logprobs: list[float] | None
    preemptions: list  # (cached tokens, generated tokens) when each preemption hit this request
    time_to_first_token: float
    total_time: float


@dataclasses.dataclass
class StreamEvent:
    index: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    output: RequestOutput | None = None
    new_logprobs: list[float] | None = None  # the new tokens' log-probabilities, when the request asked for them


@dataclasses.dataclass
class _Dispatch:
    """A step queued on the device, until the host reads its results."""

    step: ScheduledStep
    shape: tuple[int, int]  # its bucket
    packed: jax.Array  # its outputs (``step.unpack_outputs``)
    launched: float  # time.monotonic() when it was queued
    outside: float  # ``LLM._outside`` then
    unchecked: bool  # decode without stop checks (every iteration runs): the next dispatch may chain onto it


@dataclasses.dataclass
class EngineStats:
    steps: int = 0  # dispatches
    decode_dispatches: int = 0
    chained_dispatches: int = 0  # decode dispatches queued before the host read the one before (``chain_decode``)
    chained_prefills: int = 0  # prefill steps queued before the host read the one before (``chain_prefill``)
    decode_steps: int = 0  # device iterations of decode dispatches (one token per running row each)
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    preemptions: int = 0
    peak_usage: dict = dataclasses.field(default_factory=dict)
    prefix: PrefixStats = dataclasses.field(default_factory=PrefixStats)  # prefix-cache hits, this placement
    connector: ConnectorStats | None = None  # external KV connector loads and saves (None: no connector)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class LLM:
    def __init__(
        self,
        checkpoint_dir: str | os.PathLike | None = None,
        *,
        model: Apriel2ForCausalLM | ShardedModel | None = None,
        dtype: str = "bfloat16",
        tensor_parallel: int = 1,
        placement: PlacementSpec = None,
        placements: dict | None = None,
        max_num_seqs: int = DEFAULTS.max_num_seqs,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens,
        max_chunk: int | None = None,
        max_prefill_rows: int | None = None,
        page_size: int = DEFAULTS.page_size,
        decode_steps: int = DEFAULTS.decode_steps,
        chain_decode: bool = DEFAULTS.chain_decode,
        chain_prefill: bool = DEFAULTS.chain_prefill,
        cache_memory_fraction: float = DEFAULTS.cache_memory_fraction,
        cache_bytes: int | None = None,
        num_state_slots: int | None = None,
        enable_prefix_caching: bool = DEFAULTS.prefix_caching,
        snapshot_memory_fraction: float = DEFAULTS.snapshot_memory_fraction,
        snapshot_interval: int = DEFAULTS.snapshot_interval,
        kv_connector: EntryStore | None = None,
        kv_load_timeout: float = DEFAULTS.kv_load_timeout,
        seed: int = 0,
        tokenizer="auto",
        debug_checks: bool = False,
        warm_up: str | bool = DEFAULTS.warm_up,
        compilation_cache: str | os.PathLike | None = None,
        buckets: Buckets | None = None,
        step_runner: StepRunner | None = None,
        log: Callable[[str], None] | None = None,
    ):
        """``max_chunk`` (longest prefill piece of one prompt per step) defaults to the token budget and
        ``max_prefill_rows`` to ``max_num_seqs``. ``decode_steps``: tokens a decode dispatch may generate per
        sequence (a device loop with on-device stop checks; shorter while requests wait to be prefilled, see
        ``Scheduler.decode_cap``). ``chain_decode``: queue the next decode dispatch before reading the current
        one while no request can join the decode batch; ``chain_prefill``: queue the next prefill step before
        reading the current one while no request decodes (module docstring). ``warm_up``: which step shapes to
        compile before serving: "few" (decode at one row and at ``max_num_seqs`` rows), "all" or "none"; the
        others compile when first needed, as do decode steps whose rows' context needs block tables wider than
        the first width (``cache_manager.fitted_table_width``). ``compilation_cache``: directory of the persistent
        compilation cache (None: the per-user default, see ``apriel2_jax.compilation_cache``; "off" disables it).
        ``step_runner``: share compiled steps with another engine over the same model (e.g. to compare scheduler
        settings without recompiling). ``tensor_parallel``: split the model over that many devices (``apriel2_jax.sharding``);
        pages and state slots are split the same way and the cache budget is per device.
        ``enable_prefix_caching``: keep computed attention pages and recurrent-state snapshots for requests that
        share a prefix (``engine/prefix_cache.py``); snapshots take up to ``snapshot_memory_fraction`` of the
        cache budget, and prefill chunks of recurrent placements also end at multiples of ``snapshot_interval``
        tokens (a multiple of ``page_size``; 0, the default: only at page-aligned chunk ends and branch
        points). ``kv_connector``: an external store (``kv_connector.HostMemoryStore``, ``DiskStore``) that
        prefill saves prefixes to and admissions load longer prefixes from, asynchronously (needs prefix
        caching); a load taking more than ``kv_load_timeout`` seconds is abandoned and its prefix recomputed.
        ``tokenizer``: "auto" (the checkpoint directory's ``tokenizer.json`` where it has one), a ``Tokenizer``,
        or None (prompts and outputs as token ids only)."""
        if (checkpoint_dir is None) == (model is None):
            raise ValueError("give either a checkpoint directory or a loaded model")
        self.log = log if log is not None else (lambda msg: print(msg, file=sys.stderr, flush=True))
        if warm_up is True or warm_up is False:
            warm_up = "all" if warm_up else "none"
        if warm_up not in WARM_UP_CHOICES:
            raise ValueError(f"warm_up must be one of {WARM_UP_CHOICES}, got {warm_up!r}")
        if jax.process_count() > 1:  # several joined processes (hosts) run the same steps of one mesh
            if kv_connector is not None:  # a load ends when its own host's store answers
                raise CacheConfigError(f"kv_connector is not supported across several processes "
                                       f"({jax.process_count()} joined): each host's loads would finish at other "
                                       "steps and the processes' schedules would part; run without it")
            if tensor_parallel == 1 and not isinstance(model, ShardedModel):
                raise ShardingError(f"{jax.process_count()} processes are joined, but the model is not split over "
                                    f"them: give tensor_parallel (every device: {jax.device_count()})")
        self.compilation_cache_dir = enable_compilation_cache(compilation_cache)
        self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        if model is None:
            model = load_model(self.checkpoint_dir, dtype, tensor_parallel=tensor_parallel)
        elif isinstance(model, ShardedModel):
            if tensor_parallel not in (1, model.tp):
                raise ValueError(f"tensor_parallel={tensor_parallel}, but the model is split over {model.tp} devices")
        elif tensor_parallel != 1:
            model = shard_model(model, tensor_parallel)
        self.model = model
        self.config = model.config
        if isinstance(model, ShardedModel) and model.tp > 1:
            _check_split_conv_states(self.config)
        if isinstance(tokenizer, str):
            if tokenizer != "auto":
                raise ValueError(f"tokenizer must be 'auto', a Tokenizer or None, got {tokenizer!r}")
            tokenizer = None
            if self.checkpoint_dir and os.path.isfile(os.path.join(self.checkpoint_dir, TOKENIZER_FILE)):
                tokenizer = Tokenizer.from_dir(self.checkpoint_dir)
        self.tokenizer = tokenizer
        # Named placements: given, or the checkpoint's placements.json.
        self.named_placements = dict(placements or {})
        if not placements and self.checkpoint_dir and os.path.exists(os.path.join(self.checkpoint_dir, "placements.json")):
            self.named_placements = load_placements(self.checkpoint_dir)

        self.max_model_len = self.config.max_position_embeddings if max_model_len is None else max_model_len
        max_chunk = max_chunk or max_num_batched_tokens
        max_prefill_rows = max_prefill_rows or max_num_seqs
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_chunk", max_chunk),
            ("max_prefill_rows", max_prefill_rows),
            ("page_size", page_size),
            ("decode_steps", decode_steps),
            ("max_model_len", self.max_model_len),
        ):
            if not isinstance(value, int) or value < 1:
                raise CacheConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len > self.config.max_position_embeddings:  # allowed: RoPE computes any position
            self.log(f"warning: max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                     f"{self.config.max_position_embeddings} (its config): positions past it were not trained")
        if max_chunk > max_num_batched_tokens:
            raise CacheConfigError(
                f"max_chunk={max_chunk} exceeds max_num_batched_tokens={max_num_batched_tokens}: one prefill step "
                f"could never hold a whole chunk; lower max_chunk or raise max_num_batched_tokens"
            )
        if num_state_slots is not None and num_state_slots < max_num_seqs:
            raise CacheConfigError(
                f"max_num_seqs={max_num_seqs} exceeds num_state_slots={num_state_slots}: every running sequence "
                f"needs its own recurrent-state slot; lower max_num_seqs or raise num_state_slots"
            )
        if not 0.0 <= snapshot_memory_fraction < 1.0:
            raise CacheConfigError(f"snapshot_memory_fraction must be in [0, 1), got {snapshot_memory_fraction!r}")
        self.snapshot_interval = snapshot_interval
        self.enable_prefix_caching = bool(enable_prefix_caching)
        if kv_connector is not None and not self.enable_prefix_caching:
            raise CacheConfigError("kv_connector needs enable_prefix_caching=True: the connector stores prefixes "
                                   "under their prefix-cache hashes")
        self.snapshot_memory_fraction = snapshot_memory_fraction
        self.page_size = page_size
        self.seed = seed
        self.debug_checks = debug_checks
        self.buckets = buckets or Buckets.default(max_num_seqs, max_prefill_rows, max_chunk, max_num_batched_tokens)
        self.decode_steps = decode_steps
        self.chain_decode = bool(chain_decode)
        self.chain_prefill = bool(chain_prefill)
        self._in_flight: _Dispatch | None = None  # a chained dispatch the host has not read yet
        # Seconds the caller has held control (between steps, consuming events), and when that last ended; with
        # when the host last read a dispatch's results (and the first figure then), for device-time accounting.
        self._outside, self._left_at = 0.0, time.monotonic()
        self._last_read = (0.0, 0.0)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs, max_num_batched_tokens, max_chunk, max_prefill_rows, decode_steps, self.max_model_len,
            # Buckets built for the token budget keep padded steps within it; given buckets are taken as they are.
            padded_size=self._padded_prefill_size if self.buckets.max_tokens is not None else None,
            decode_steps_while_prefilling=stop_check_group(decode_steps),
        )
        self._warm_up = warm_up
        self._cache_bytes = cache_bytes if cache_bytes is not None else self._budget_from_device(cache_memory_fraction)
        graphdef = model.graphdef if isinstance(model, ShardedModel) else nnx.graphdef(model)
        if step_runner is not None and step_runner.graphdef != graphdef:
            raise ValueError("step_runner was built for a different model")
        self.runner = step_runner if step_runner is not None else StepRunner(model, self.log)
        self.stats = EngineStats()
        self.kv_connector = None
        if kv_connector is not None:
            # Loaded arrays are copied to the device on the load worker, while the engine keeps stepping; the
            # copy is complete (and never aliases the worker's reused host buffers) when ``stage`` returns. On
            # an accelerator one batched transfer reads the host buffers directly (jnp.array(copy=True) first made
            # a fresh host copy: 1.6 GB of new pages for an 8K-token 15B prefix); the CPU backend may alias a
            # numpy buffer instead of copying it, so there the copy stays.
            if jax.default_backend() == "cpu":
                def stage(arrays):
                    return jax.block_until_ready(jax.tree.map(lambda a: jnp.array(a, copy=True), arrays))
            else:
                def stage(arrays):
                    return jax.block_until_ready(jax.device_put(arrays))

            self.kv_connector = KVConnector(kv_connector, kv_load_timeout, stage=stage, log=self.log)
            self.stats.connector = self.kv_connector.stats
        self._request_counter = 0
        self._cache = None
        self.placement = None
        self.set_placement(placement)

    def reset_stats(self) -> None:
        """Start the counters (steps, tokens, times, prefix-cache hits) from zero; the caches are kept."""
        self.stats = EngineStats()
        if self.prefix_cache is not None:
            self.prefix_cache.attach_stats(self.stats.prefix)
        if self.kv_connector is not None:
            self.kv_connector.stats = self.stats.connector = ConnectorStats()

    # ------------------------------------------------------------------------------------------------------------
    def _budget_from_device(self, fraction: float) -> int:
        if not 0.0 < fraction <= 1.0:
            raise CacheConfigError(f"cache_memory_fraction must be in (0, 1], got {fraction!r}")
        if isinstance(self.model, ShardedModel):  # this process's devices (a mesh may span hosts)
            devices = [d for d in self.model.mesh.devices.flat if d.process_index == jax.process_index()]
        else:
            devices = jax.local_devices()[:1]
        # Several processes (hosts) must size one mesh's caches alike: the smallest budget of any.
        return agree_on_minimum(self._local_budget(devices, fraction))

    @staticmethod
    def _local_budget(devices, fraction: float) -> int:
        """Cache bytes per device that ``devices`` can all hold (tensor parallel: every device holds its share of
        every page, so the tightest rules)."""
        budgets = []
        for device in devices:
            stats = device.memory_stats() or {}
            limit = stats.get("bytes_limit")
            if not limit:
                return DEFAULT_CPU_CACHE_BYTES  # CPU: no device memory figure; use a fixed budget
            budgets.append(max(0, int(limit * fraction) - int(stats.get("bytes_in_use", 0))))
        return min(budgets)

    def set_placement(self, placement: PlacementSpec = None) -> None:
        """Run the supernet with another placement. Clears the caches (no request may be in flight); compiled
        steps of placements used before are reused."""
        resolved = resolve_placement(self.config, placement, self.named_placements)
        if resolved == self.placement:
            return
        if self._cache is not None and self.scheduler.has_work:
            raise RuntimeError("cannot switch placement while requests are in flight")
        self._drop_in_flight()
        self._cache = None  # free the old arrays before allocating the new ones
        dtype_bytes = np.dtype(self.model.dtype).itemsize
        # Per device: a tensor-parallel device holds its heads' share of every page and state slot.
        per_device = self.model.local_config if isinstance(self.model, ShardedModel) else self.config
        self.layout = cache_layout(per_device, resolved, dtype_bytes)
        plan = plan_cache(
            self.layout,
            budget_bytes=self._cache_bytes,
            page_size=self.page_size,
            max_num_seqs=self.scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            # A chained dispatch's pages are allocated while the one before still holds its own: two dispatches.
            max_chunk=max(self.scheduler_config.max_chunk, self.decode_steps * (2 if self.chain_decode else 1)),
            snapshot_bytes=int(self._cache_bytes * self.snapshot_memory_fraction) if self.enable_prefix_caching else 0,
        )
        self.plan = plan
        self.cache_manager = CacheManager(self.layout, plan)
        self.stats.prefix = PrefixStats()
        self.prefix_cache = None
        if self.enable_prefix_caching:  # a new placement starts with an empty prefix cache
            self.prefix_cache = PrefixCache(
                self.cache_manager, prefix_root(resolved, plan.page_size), (plan.slots, plan.snapshots),
                stats=self.stats.prefix, snapshot_interval=self.snapshot_interval,
            )
            if self.layout.state is not None and not plan.snapshots:
                self.log("prefix cache: no room for one recurrent-state snapshot, so no prefix can be reused under "
                         "this placement; raise snapshot_memory_fraction or the cache budget")
        self.scheduler = Scheduler(self.scheduler_config, self.cache_manager, self.prefix_cache, self.kv_connector)
        self.placement = resolved
        self.log(f"cache: {plan.summary(self.layout)}")
        rows = plan.slots + plan.snapshots  # state arrays: slots, then snapshots
        if isinstance(self.model, ShardedModel):
            self._cache = self.model.init_paged_cache(resolved, plan.pages, plan.page_size, rows)
        else:
            self._cache = jax.jit(lambda: self.model.init_paged_cache(resolved, plan.pages, plan.page_size, rows))()
        if self.kv_connector is not None:
            self.kv_connector.configure(plan.page_size, *transfer.row_specs(self._cache, self.layout))
        if self._warm_up != "none":
            self.compile_steps(self._warm_up_shapes(), both_samplers=self._warm_up == "all")

    def compile_steps(self, shapes: Sequence[tuple[int, int]], both_samplers: bool = False) -> None:
        """Compile these step shapes (``(rows, tokens)``; tokens 1 for decode) now instead of on first use, e.g.
        the shapes a known workload will run. Shapes outside the engine's buckets raise ValueError."""
        known = set(self.buckets.shapes())
        unknown = [shape for shape in shapes if tuple(shape) not in known]
        if unknown:
            raise ValueError(f"step shapes {unknown} are not among the engine's buckets {sorted(known)}")
        self._cache = self.runner.warm_up(
            self._cache, [tuple(s) for s in shapes], self.cache_manager, self.placement, self.decode_steps, self.log,
            both_samplers=both_samplers,
        )

    def _warm_up_shapes(self) -> list[tuple[int, int]]:
        if self._warm_up == "all":
            return self.buckets.shapes()
        rows = self.buckets.decode_rows
        return sorted({(rows[0], 1), (rows[-1], 1)})

    def _padded_prefill_size(self, rows: int, tokens: int) -> int:
        """Tokens a prefill step of ``rows`` rows, the longest ``tokens`` long, computes once padded."""
        try:
            padded_rows, width = self.buckets.pick("prefill", rows, tokens)
        except ValueError:
            return sys.maxsize
        return padded_rows * width

    # ------------------------------------------------------------------------------------------------------------
    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (LLM(tokenizer=None), or no tokenizer.json in its "
                                 "checkpoint): pass prompts as lists of token ids")
            return list(self.tokenizer.encode(prompt))
        # Integer arrays (and lists of ints) are checked in one numpy pass: a batch of long prompts is ~1M ids.
        array = np.asarray(prompt)
        if array.ndim == 1 and array.size and np.issubdtype(array.dtype, np.integer):
            ids, outside = array.tolist(), (array < 0) | (array >= self.config.vocab_size)
            bad = array[outside][:5].tolist()
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def _new_request(self, prompt, params: SamplingParams | None, index: int = 0) -> Request:
        """A request with a fresh id (unique over the engine's life) for ``prompt`` (text or token ids)."""
        ids = self._encode(prompt)
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; the model context (max_model_len) is "
                f"{self.max_model_len}, which must leave room for at least one generated token"
            )
        params = params if params is not None else SamplingParams()
        request = Request(self._request_counter, ids, params)
        request.seed = request_seed(params, self._request_counter, self.seed)
        request.checker = StopChecker(params, self.config.eos_token_ids)
        self._request_counter += 1
        return request

    def _make_requests(self, prompts, params) -> list[Request]:
        if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        return [self._new_request(prompt, p, index) for index, (prompt, p) in enumerate(zip(prompts, params_list))]

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        outputs: dict[int, RequestOutput] = {}
        for event in self.stream(prompts, params):
            if event.finished:
                outputs[event.index] = event.output
        return [outputs[i] for i in sorted(outputs)]

    def stream(self, prompts, params=None, *, assume_prefilled: bool = False) -> Iterator[StreamEvent]:
        """Yield each request's new tokens (and text) as they are produced, then a final event per request.
        Events (and outputs) carry the prompt's index in ``prompts``. Requests still unfinished when the caller
        stops iterating are aborted.

        ``assume_prefilled`` is for benchmarks only: the prompts are admitted as already cached (pages and
        slots allocated, contents not computed) and decoding starts at once; outputs are meaningless."""
        if self.has_unfinished_requests:
            raise RuntimeError("stream/generate need an idle engine; requests added with add_request are running")
        requests = self._make_requests(prompts, params)
        index = {request.request_id: i for i, request in enumerate(requests)}
        start = time.monotonic()
        for request in requests:
            request.timings["start"] = start
            if assume_prefilled:
                self.scheduler.admit_cached(request, request.num_tokens - 1)
            else:
                self.scheduler.add(request)
        try:
            while self.scheduler.has_work:
                for event in self._step():
                    event.index = index[event.index]
                    if event.output is not None:
                        event.output.index = event.index
                    yield event
        finally:
            for request in requests:
                self.scheduler.abort(request.request_id)
            self._drop_in_flight()

    # Incremental API (a server's engine loop): add requests at any time, run one step at a time.
    def add_request(self, prompt, params: SamplingParams | None = None) -> int:
        """Queue one request (text or token ids); returns its id, which its events and output carry. Raises
        ``ValueError`` for a prompt the engine cannot take (empty, too long, ids outside the vocabulary)."""
        request = self._new_request(prompt, params)
        request.timings["start"] = time.monotonic()
        self.scheduler.add(request)
        return request.request_id

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StreamEvent]:
        """Run one engine step (nothing when idle); the events of the tokens it produced."""
        if not self.scheduler.has_work:
            self._drop_in_flight()
            return []
        return list(self._step())

    def abort(self, request_id: int) -> bool:
        """Drop a queued or running request and free its pages and slot; False when it is not in flight."""
        return self.scheduler.abort(request_id) is not None

    # ------------------------------------------------------------------------------------------------------------
    def _apply_copies(self) -> None:
        """Run the prefix cache's queued state-row copies: snapshots saved, then snapshots restored."""
        if self.prefix_cache is not None and self.layout.state:
            for pairs in self.prefix_cache.take_copies():
                self._cache = self.runner.copy_state_rows(self._cache, self.layout.state.layers, pairs)

    def _step(self) -> Iterator[StreamEvent]:
        self._outside += time.monotonic() - self._left_at
        try:
            yield from self._step_inner()
        finally:
            self._left_at = time.monotonic()

    def _step_inner(self) -> Iterator[StreamEvent]:
        if self._in_flight is not None:
            if any(row.request.status is RequestStatus.RUNNING for row in self._in_flight.step.rows):
                dispatch, self._in_flight = self._in_flight, None
                yield from self._finish(dispatch)
                return
            self._drop_in_flight()  # all its requests ended (stops, aborts): this step schedules afresh
        if self.kv_connector is not None and self.scheduler.loading:
            self._finish_loads(self.kv_connector.poll())
        step = self.scheduler.schedule()
        if step is None:
            if self.scheduler.loading:  # only loads in flight: a zero-token step waits for one of them
                self.kv_connector.wait(0.05)
                return
            raise RuntimeError("the scheduler has waiting requests but can run nothing; this is a bug")
        dispatch = self._launch(step)
        if dispatch is not None:
            yield from self._finish(dispatch)

    def _launch(self, step: ScheduledStep) -> "_Dispatch | None":
        """Queue a scheduled step on the device (None for a step without rows). A prefill step counts as done
        once queued: its tokens are cached for whatever is queued after it, and its completed pages are saved to
        the connector from there."""
        self.stats.preemptions += len(step.preempted)
        self._apply_copies()  # before the step, and before a load writes into a slot a restore targets
        if not step.rows:
            return None
        shape = self.buckets.pick(step.kind, len(step.rows), max(r.length for r in step.rows))
        decode = step.kind == "decode"
        inputs = build_inputs(step, shape, self.cache_manager, [r.budget for r in step.rows], self.config.eos_token_ids)
        # A dispatch the next may chain onto runs without stop checks: the call returns once it is queued (every
        # row's budget is the whole dispatch, so only rows stopped at a stop id could end it early).
        unchecked = decode and self.chain_decode and all(
            row.budget == self.decode_steps and device_stops_exactly(row.request, self.config.eos_token_ids)
            for row in step.rows)
        launched = time.monotonic()
        packed, self._cache = self.runner.run(self._cache, inputs, self.placement, self.decode_steps if decode else 1,
                                              stop_checks=not unchecked)
        if not decode:
            self.scheduler.complete(step)
            if self.kv_connector is not None:
                self._save_prefill(step)
        return _Dispatch(step, shape, packed, launched, self._outside, unchecked)

    def _finish(self, dispatch: "_Dispatch") -> Iterator[StreamEvent]:
        """Read a dispatch's results and hand out its tokens; first chain the next decode dispatch (or prefill
        step) onto it when nothing the results could say would change that dispatch."""
        step = dispatch.step
        decode = step.kind == "decode"
        if dispatch.unchecked:
            self._in_flight = self._chain(dispatch)
        elif not decode and self.chain_prefill:
            ahead = self.scheduler.schedule_ahead()
            if ahead is not None:
                self._in_flight = self._launch(ahead)
                self.stats.chained_prefills += 1
        if self.prefix_cache is not None:
            # Host work for the next admissions while the device runs this step. It sits inside the step timer,
            # which it lengthens only where hashing outlasts the step (each request is hashed once).
            self.prefix_cache.hash_ahead(itertools.islice(self.scheduler.waiting, QUEUE_LOOKAHEAD))
        outputs = unpack_outputs(dispatch.packed)
        now = time.monotonic()
        # A chained dispatch starts on the device when the one before it ends, which is about when its results
        # were read: device time per dispatch, not counting time the device spent on the previous one, nor time
        # the caller held control since (between steps, or consuming events), when the device may have idled.
        if dispatch.launched >= self._last_read[0]:
            start, outside = dispatch.launched, dispatch.outside
        else:
            start, outside = self._last_read
        elapsed = now - start - (self._outside - outside)
        self._last_read = (now, self._outside)
        tokens, logprobs = outputs.tokens, outputs.logprobs
        # A chained dispatch's rows whose requests ended while it was queued (a stop in the dispatch before, or an
        # abort) ran as padding or wrote past their end: their results are dropped.
        live = [(i, row) for i, row in enumerate(step.rows) if row.request.status is RequestStatus.RUNNING]
        if len(live) < len(step.rows):
            step = dataclasses.replace(step, rows=tuple(row for _, row in live))
        # Tokens each decode row generated before the device stopped it (its budget or one of its stop ids).
        fed = {row.request: int(outputs.counts[i]) for i, row in live} if decode else {}
        self.stats.steps += 1
        if decode:
            self.stats.decode_dispatches += 1
            # Without stop checks the device runs every iteration even after all rows have stopped.
            self.stats.decode_steps += self.decode_steps if dispatch.unchecked else outputs.steps
            self.stats.decode_tokens += sum(fed.values())
            self.stats.decode_seconds += elapsed
        else:
            self.stats.prefill_tokens += step.num_tokens
            self.stats.prefill_seconds += elapsed
        for family, (used, _) in self.cache_manager.usage().items():
            self.stats.peak_usage[family] = max(self.stats.peak_usage.get(family, 0), used)
        if decode:  # a prefill step was completed when it was queued
            self.scheduler.complete(step, fed)
        now = time.monotonic()
        for i, row in live:
            if row.samples:
                count = fed.get(row.request, 1)
                for event in self._append(row.request, tokens[:count, i].tolist(), logprobs[:count, i].tolist(), now):
                    left = time.monotonic()
                    yield event
                    self._outside += time.monotonic() - left
        if self.debug_checks:
            self.scheduler.check_invariants()

    def _chain(self, dispatch: "_Dispatch") -> "_Dispatch | None":
        """Queue the decode dispatch that follows ``dispatch`` before its results are read, or return None.

        It is the step the scheduler would give ``dispatch``'s rows whose requests still run, once ``dispatch`` ran
        its whole budget (rows it stops at a stop id run as padding, from the carry on the device), so it is
        chained only when nothing in ``dispatch``'s results could change the next schedule but such a stop: every
        running request is one of its rows, none is loading or waiting, the rows fit the same bucket, each row's
        stop conditions are checked on the device exactly, each row has room for another whole dispatch, and its
        pages are free now (nothing is preempted for a chained dispatch). Rows whose requests ended (a stop seen
        in the dispatch before, an abort) are left out, the others keep their order."""
        live = [(i, row) for i, row in enumerate(dispatch.step.rows) if row.request.status is RequestStatus.RUNNING]
        scheduler, steps = self.scheduler, self.decode_steps
        # A waiting request is admitted as soon as a row stops and frees its slot; a dispatch queued behind the
        # stop would hold its prefill back a whole dispatch.
        if not live or scheduler.loading or scheduler.waiting or len(scheduler.running) != len(live):
            return None
        if self.buckets.pick("decode", len(live), 1) != dispatch.shape:
            return None  # the previous outputs' shape is part of the compiled step: one variant per bucket
        for _, row in live:
            request = row.request
            if not device_stops_exactly(request, self.config.eos_token_ids):
                return None
            if scheduler.tokens_left(request) < row.budget + steps:  # this dispatch's budget, then a whole one
                return None
        for _, row in live:
            # From the dispatch's own start: pages a sliding window leaves behind are released only after its
            # pages are published, as the scheduler does.
            if not self.cache_manager.try_allocate(row.request.request_id, row.start, row.budget + steps):
                return None
        step = ScheduledStep("decode", tuple(ScheduledRow(row.request, row.start + row.budget, 1, True, steps)
                                             for _, row in live), ())
        inputs = build_inputs(step, dispatch.shape, self.cache_manager, [steps] * len(live),
                              self.config.eos_token_ids, in_flight=[(i, row.budget) for i, row in live])
        launched = time.monotonic()
        packed, self._cache = self.runner.run(self._cache, inputs, self.placement, steps, previous=dispatch.packed,
                                              stop_checks=False)
        self.stats.chained_dispatches += 1
        return _Dispatch(step, dispatch.shape, packed, launched, self._outside, unchecked=True)

    def _drop_in_flight(self) -> None:
        """Forget a chained dispatch whose requests all ended before it was read (waiting for it, so its device
        time does not count in what runs next). A caller may stop stepping once nothing is unfinished, so the next
        step, or the next stream, drops it too."""
        if self._in_flight is not None:
            jax.block_until_ready(self._in_flight.packed)
            self._in_flight = None
            self._last_read = (time.monotonic(), self._outside)

    # ------------------------------------------------------------------------------------------------------------
    def _finish_loads(self, results: list[LoadResult]) -> None:
        """Write what finished loads read into their requests' pages and slot, then let them run (or go back to
        the queue when a load stopped short of its claim)."""
        if not results:
            return
        self._apply_copies()  # a restore queued into a slot must land before a load overwrites it
        size = self.page_size
        for result in results:
            request = self.scheduler.loading.get(result.request_id)
            if request is None:  # aborted while loading
                continue
            tokens = result.good_pages * size
            if result.good_pages > result.first_page:
                blocks = self.cache_manager.blocks(request.request_id)
                pages, values = {}, {}
                for family, table in blocks.tables.items():
                    first = max(result.first_page, blocks.first_page[family])  # window: only pages it holds
                    if first >= result.good_pages:
                        continue
                    offset = blocks.first_page[family]
                    pages[family] = np.array(table[first - offset : result.good_pages - offset], np.int32)
                    skip = first - result.first_page
                    for name, rows in result.pages.items():
                        if name.split("/")[0] == family:
                            values[name] = rows[skip:] if skip else rows
                state_rows = None
                if result.state is not None:
                    values.update(result.state)
                    state_rows = np.array([blocks.slot], np.int32)
                self._cache = transfer.write_rows(self._cache, self.layout, pages, values, state_rows)
                self.stats.connector.tokens_loaded += tokens - result.first_page * size
            self.scheduler.finish_load(request, tokens)

    def _save_prefill(self, step) -> None:
        """Queue saves of the pages this prefill step completed (and of the state at chunk ends on a page
        boundary) that the store lacks; the device gather is dispatched now, the host copy and the store writes
        run on the connector's save worker."""
        size = self.page_size
        connector = self.kv_connector
        page_keys, page_ids, state_keys, state_slots = [], {f: [] for f in self.cache_manager.pools}, [], []
        for row in step.rows:
            request = row.request
            if not request.prefix_cacheable or not self.cache_manager.holds(request.request_id):
                continue
            blocks = self.cache_manager.blocks(request.request_id)
            done = request.num_computed // size
            chain = self.prefix_cache.chain(request, done)
            for j in range(request.saved_pages, done):
                index = {f: j - blocks.first_page[f] for f in blocks.tables}
                if all(0 <= i < len(blocks.tables[f]) for f, i in index.items()) and not connector.contains("page", chain[j]):
                    page_keys.append(chain[j])
                    for family, i in index.items():
                        page_ids[family].append(blocks.tables[family][i])
            request.saved_pages = max(request.saved_pages, done)
            end = row.start + row.length
            if self.layout.state is not None and end % size == 0 and end == request.num_computed:
                key = chain[end // size - 1]
                if not connector.contains("state", key):
                    state_keys.append(key)
                    state_slots.append(blocks.slot)
        if not page_keys and not state_keys:
            return
        pages = {f: np.array(ids, np.int32) for f, ids in page_ids.items()} if page_keys else {}
        gathered, counts = transfer.gather_rows(self._cache, self.layout, pages,
                                                np.array(state_slots, np.int32) if state_keys else None)

        def build() -> list[Entry]:
            host = transfer.to_host(gathered, counts)
            entries = []
            for i, key in enumerate(page_keys):
                entries.append(Entry("page", key, {n: a[i] for n, a in host.items() if not n.startswith("state/")}))
            for i, key in enumerate(state_keys):
                entries.append(Entry("state", key, {n: a[i] for n, a in host.items() if n.startswith("state/")}))
            return entries

        connector.save(build)

    @staticmethod
    def _unsent_text(request: Request, finished: bool) -> str:
        """The text a stream may show now: never a trailing U+FFFD (half of a multi-byte character) nor what
        could be the start of a stop string, so streamed pieces concatenate to the final text."""
        text = request.text
        end = len(text)
        if not finished:
            while end > request.streamed_chars and text[end - 1] == "\ufffd":
                end -= 1
            hold = max((len(stop) for stop in request.params.stop), default=1) - 1
            end -= hold
        if end <= request.streamed_chars:
            return ""
        piece = text[request.streamed_chars : end]
        request.streamed_chars = end
        return piece

    def _append(self, request: Request, tokens: list[int], logprobs: list[float], now: float) -> Iterator[StreamEvent]:
        """Add a row's new tokens to its request: one event for all of them (the request finished if its stop
        check says so, and the tokens after its stop are dropped)."""
        checker, reason = request.checker, None
        if not tokens:
            return
        if self.tokenizer is not None and checker.needs_text:
            # Stop strings are found token by token, so the output ends on the token that completed one.
            for j, token in enumerate(tokens):
                request.output_ids.append(token)
                request.text = self.tokenizer.decode(request.output_ids)
                reason, cut = checker(request.output_ids, request.text)
                if reason is None and request.num_tokens >= self.max_model_len:
                    reason = "length"
                if reason is not None:
                    tokens, logprobs = tokens[: j + 1], logprobs[: j + 1]
                    if cut is not None:
                        request.text = request.text[:cut]
                    break
        else:
            keep, reason = checker.scan(tokens, len(request.output_ids), self.max_model_len - request.num_tokens)
            tokens, logprobs = tokens[:keep], logprobs[:keep]
            request.output_ids += tokens
            if self.tokenizer is not None:
                request.text = self.tokenizer.decode(request.output_ids)
        if request.params.logprobs:
            request.logprobs += logprobs
        request.timings.setdefault("first_token", now)
        new_text = self._unsent_text(request, finished=reason is not None)
        new_logprobs = logprobs if request.params.logprobs else None
        if reason is None:
            yield StreamEvent(request.request_id, tokens, new_text, False, new_logprobs=new_logprobs)
            return
        self.scheduler.finish(request, reason)
        start = request.timings["start"]
        output = RequestOutput(
            index=request.request_id,
            prompt_ids=request.prompt_ids,
            token_ids=list(request.output_ids),
            text=request.text if self.tokenizer is not None else None,
            finish_reason=reason,
            logprobs=list(request.logprobs) if request.params.logprobs else None,
            preemptions=list(request.preemptions),
            time_to_first_token=request.timings["first_token"] - start,
            total_time=now - start,
        )
        yield StreamEvent(request.request_id, tokens, new_text, True, output, new_logprobs)


def _check_split_conv_states(config) -> None:
    """A convolution of kernel size 1 keeps no history: its cache state is [slots, 0, channels]. XLA (jaxlib 0.11.2,
    CPU) crashes the process compiling a split step that carries such an empty array, so it is refused here."""
    for i, block in enumerate(config.blocks):
        mixers = block.mixer.mixers if isinstance(block.mixer, StochasticConfig) else (("", block.mixer),)
        for name, mixer in mixers:
            kernel = getattr(mixer, "conv_kernel_size", getattr(mixer, "d_conv", None))
            if kernel == 1:
                where = f"layer {i}" + (f" mixer {name!r}" if name else "")
                raise ShardingError(f"{where}: a convolution of kernel size 1 (no conv history) is not supported "
                                    f"with tensor parallelism, whose compiled step crashes XLA on its empty conv "
                                    f"state; run this model with tensor_parallel=1")
