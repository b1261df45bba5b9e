"""Continuous batching with chunked prefill, decode, preemption by recompute, and abort. Plain Python.

Each step is either a *decode* step (every running request whose tokens are all cached except the last sampled
one feeds that token: rows of length 1) or a *prefill* step (chunks of prompts, any chunk size, under a token
budget). The two kinds alternate while both have work, so long prompts never starve decoding and decoding never
blocks admission. A decode row costs one token slot; mixing it into a padded prefill step would cost a whole
chunk, which is why the kinds are kept apart. A decode row carries a *budget*: the tokens the step may generate
for it in one dispatch (``decode_steps``, fewer near ``max_new_tokens`` or ``max_model_len`` and while requests
wait to be prefilled: ``Scheduler.decode_cap``), with pages for all of them allocated up front; when they are not
free the row gets a budget of one token (and the usual preemption), so speculative allocation never preempts
anyone.

A request is "done prefilling" once its cached length reaches ``num_tokens - 1``: the last token is either the
last prompt token (fed in the final chunk, whose logits give the first sampled token) or a sampled token that
decode feeds. Preemption (newest first) releases a request's pages and slot and sends it back to the front of
the waiting queue with nothing cached; it then recomputes prompt + generated tokens in one prefill.

With an external KV connector (``kv_connector/``), an admitted request whose prefix the store holds beyond the
local prefix cache gets its blocks up to the claim and waits in ``loading`` (its own state: never scheduled,
never preempted, never re-claimed) while the load runs and other requests step. When the load is done
(:meth:`Scheduler.finish_load`) it runs from the claim; a load that stopped short publishes what it loaded and
the request goes back to the front of the queue, to be admitted again from whatever prefix every family then
has cached, without the connector, so block tables are always rebuilt consistently.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
from typing import TYPE_CHECKING, Any, Callable, Hashable

from .cache_manager import CacheManager
from .prefix_cache import PrefixCache

if TYPE_CHECKING:
    from .kv_connector import KVConnector


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # blocks held, prefix being loaded from an external store
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: Hashable
    prompt_ids: list[int]
    params: Any  # SamplingParams
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V and state are in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    arrival: int = 0
    preemptions: list = dataclasses.field(default_factory=list)  # (cached tokens, generated tokens) at each
    seed: int = 0
    text: str = ""
    streamed_chars: int = 0  # characters of ``text`` already streamed
    checker: Any = None  # StopChecker of this request
    timings: dict = dataclasses.field(default_factory=dict)
    # Prefix caching: the hash chain of the request's full pages, how many of them are published, and whether
    # its cache contents are real (False for benchmark admissions that skip the prefill).
    page_hashes: list = dataclasses.field(default_factory=list)
    cached_pages: int = 0
    prefix_cacheable: bool = True
    # External KV connector: the load in flight (local prefix tokens, claimed tokens), pages known to be in the
    # store (nothing before them is saved again), and whether a load of this request already failed.
    load: tuple[int, int] | None = None
    saved_pages: int = 0
    skip_connector: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    @property
    def num_preemptions(self) -> int:
        return len(self.preemptions)

    @property
    def pending(self) -> int:
        """Tokens to feed before the next sample."""
        return self.num_tokens - self.num_computed


@dataclasses.dataclass(frozen=True)
class ScheduledRow:
    request: Request
    start: int  # first position fed this step
    length: int  # tokens fed this step
    samples: bool  # the step ends this request's pending tokens: sample from its last logits
    budget: int = 1  # decode: the most tokens the step may generate for this row (its pages are allocated)


@dataclasses.dataclass(frozen=True)
class ScheduledStep:
    kind: str  # "decode" or "prefill"
    rows: tuple[ScheduledRow, ...]
    preempted: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        return sum(r.length for r in self.rows)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int  # token budget of a prefill step
    max_chunk: int  # longest prefill chunk of one request in one step
    max_prefill_rows: int  # requests in one prefill step
    decode_steps: int = 1  # tokens a decode step may generate per row (device loop, one dispatch)
    max_model_len: int | None = None  # a decode row's budget never runs a request past it
    # (rows, longest row) -> tokens the step computes once padded to its shape; a prefill step stays within
    # max_num_batched_tokens counted this way, so padding never makes a step larger than the budget
    padded_size: Callable[[int, int], int] | None = None
    # Tokens a decode dispatch may generate while prefill work could run (a prompt partly prefilled, a prefix
    # being loaded, or a waiting request the last prefill attempt could admit): a longer device loop holds that
    # prefill back until it ends. The LLM passes the device loop's stop-check group (``step.stop_check_group``):
    # a dispatch runs whole groups, so shortened dispatches are multiples of it.
    decode_steps_while_prefilling: int = 4


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager, prefix: PrefixCache | None = None,
                 connector: "KVConnector | None" = None):
        if connector is not None and prefix is None:
            raise ValueError("an external KV connector needs prefix caching (entries are named by prefix hashes)")
        self.config = config
        self.cache = cache
        self.prefix = prefix
        self.connector = connector
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.loading: dict[Hashable, Request] = {}  # requests whose prefix is being loaded by the connector
        self._arrivals = itertools.count()
        self._last_kind = "prefill"
        self._prefill_blocked = False  # the last prefill attempt found waiting requests but scheduled nothing

    # ------------------------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.arrival = next(self._arrivals)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def admit_cached(self, request: Request, cached_tokens: int) -> None:
        """Benchmarking only: admit ``request`` as if its first ``cached_tokens`` tokens were already in the
        cache (pages and slot allocated, contents not computed), so decode speed at a long context can be
        measured without running the prefill."""
        if self.num_admitted >= self.config.max_num_seqs:
            raise RuntimeError(f"cannot admit: {len(self.running)} requests already running (max_num_seqs)")
        if not 0 <= cached_tokens < request.num_tokens:
            raise ValueError(f"cached_tokens must be in [0, {request.num_tokens}), got {cached_tokens}")
        if not self.cache.try_allocate(request.request_id, cached_tokens, 0):
            self.cache.free(request.request_id)
            raise RuntimeError(f"cannot admit: no cache room for {cached_tokens} tokens")
        request.arrival = next(self._arrivals)
        request.num_computed = cached_tokens
        request.prefix_cacheable = False  # its cache holds no real contents
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def abort(self, request_id: Hashable) -> Request | None:
        request = self.loading.pop(request_id, None)
        if request is not None:
            self.connector.cancel(request_id)
            request.load = None
            self._release(request)
            request.status = RequestStatus.FINISHED
            request.finish_reason = "abort"
            return request
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._release(request)
                    request.status = RequestStatus.FINISHED
                    request.finish_reason = "abort"
                    return request
        return None

    def finish(self, request: Request, reason: str) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def num_admitted(self) -> int:
        return len(self.running) + len(self.loading)

    # ------------------------------------------------------------------------------------------------------------
    def _release(self, request: Request) -> None:
        """Give back the request's pages and slot (its computed pages stay cached with prefix caching)."""
        if self.prefix is not None:
            self.prefix.release(request)
        self.cache.free(request.request_id)

    def _chunk(self, request: Request, budget: int) -> int:
        """Tokens of the request's next prefill chunk (from ``num_computed``) within ``budget``."""
        start = request.num_computed
        end = start + min(request.pending, self.config.max_chunk, budget)
        if self.prefix is not None:
            end = self.prefix.chunk_end(request, start, end, self.waiting)
        return end - start

    def _preempt_newest(self) -> Request:
        request = self.running.pop()
        self._release(request)
        request.preemptions.append((request.num_computed, len(request.output_ids)))
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        return request

    def _allocate(self, request: Request, length: int, preempted: list[Request] | None) -> bool:
        """Pages and slot for the next ``length`` tokens of a running request. When a pool is short, the newest
        running request is preempted, until the allocation fits or the requester itself was the newest
        (``preempted`` None: nobody is preempted, the allocation fails)."""
        while not self.cache.try_allocate(request.request_id, request.num_computed, length):
            if preempted is None:
                return False
            victim = self._preempt_newest()
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def schedule(self) -> ScheduledStep | None:
        """The next step, or None when there is nothing to run."""
        has_decode, has_prefill = self._has_work_of_each_kind()
        first_decode = has_decode and (not has_prefill or self._last_kind == "prefill")
        preempted: list[Request] = []
        for kind in ("decode", "prefill") if first_decode else ("prefill", "decode"):
            rows = self._schedule_decode(preempted) if kind == "decode" else self._schedule_prefill(preempted)
            if kind == "prefill":
                self._prefill_blocked = not rows and bool(self.waiting)
            if rows:
                self._last_kind = kind
                return ScheduledStep(kind, tuple(rows), tuple(preempted))
        return ScheduledStep("idle", (), tuple(preempted)) if preempted else None

    def schedule_ahead(self) -> ScheduledStep | None:
        """A prefill step to queue on the device behind one whose results the host has not read yet (the
        caller has already ``complete``d it: its tokens count as cached), or None.

        Only prefill work is scheduled ahead, and only while no request decodes: a prefill step's own results
        change nothing another prefill step feeds, but the rows it samples from decode only once their tokens
        are read (until then their ``pending`` is 0, so neither kind schedules them), and with decoding rows
        the kinds alternate as in :meth:`schedule`. Nobody is preempted: a request that the unread step is
        about to finish may free the pages a preemption would take. A prefill that admits nothing says nothing
        about whether the waiting requests are blocked (slots the unread step's requests hold may free)."""
        has_decode, has_prefill = self._has_work_of_each_kind()
        if has_decode or not has_prefill:
            return None
        blocked = self._prefill_blocked
        rows = self._schedule_prefill(None)
        self._prefill_blocked = blocked
        if not rows:
            return None
        self._last_kind = "prefill"
        return ScheduledStep("prefill", tuple(rows), ())

    def _has_work_of_each_kind(self) -> tuple[bool, bool]:
        has_decode = any(r.pending == 1 for r in self.running)
        has_prefill = bool(self.waiting) or any(r.pending > 1 for r in self.running)
        return has_decode, has_prefill

    def tokens_left(self, request: Request) -> int:
        """Tokens ``request`` may still generate: up to ``max_new_tokens`` and the context limit."""
        left = request.params.max_new_tokens - len(request.output_ids)
        if self.config.max_model_len is not None:
            left = min(left, self.config.max_model_len - request.num_tokens)
        return left

    def decode_budget(self, request: Request) -> int:
        """Tokens one decode step may generate for ``request``: ``decode_steps``, fewer near its end."""
        return max(1, min(self.config.decode_steps, self.tokens_left(request)))

    def decode_cap(self) -> int:
        """The most tokens any row may generate in the next decode dispatch. The rows run in one device loop, so
        with requests waiting a long loop would delay them: while prefill work could run (a prompt partly
        prefilled, a prefix being loaded, or a waiting request the last prefill attempt could admit), the
        dispatch is short (``decode_steps_while_prefilling``); while the waiting requests cannot be admitted
        (every slot taken, no pages, or their prefix still being computed), it ends when the first running request
        reaches its token limit, so that request's slot and pages go to a waiting one at once instead of idling
        until the loop ends."""
        cap, short = self.config.decode_steps, max(1, self.config.decode_steps_while_prefilling)
        running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        admissible = self.waiting and not self._prefill_blocked and self.num_admitted < self.config.max_num_seqs
        if admissible or self.loading or any(r.pending > 1 for r in running):
            return min(cap, short)
        if self.waiting:
            ends = [self.decode_budget(r) for r in running if r.pending == 1]
            if ends:
                cap = min(cap, -(-min(ends) // short) * short)
        return cap

    def _schedule_decode(self, preempted: list[Request]) -> list[ScheduledRow]:
        rows = []
        cap = self.decode_cap()
        for request in list(self.running):
            if request.status is RequestStatus.RUNNING and request.pending == 1:
                budget = min(self.decode_budget(request), cap)
                # Pages for the whole budget if they are free; otherwise one token, preempting if need be.
                if budget > 1 and not self.cache.try_allocate(request.request_id, request.num_computed, budget):
                    budget = 1
                if budget > 1 or self._allocate(request, 1, preempted):
                    rows.append(ScheduledRow(request, request.num_computed, 1, True, budget))
        return [row for row in rows if row.request.status is RequestStatus.RUNNING]

    def _schedule_prefill(self, preempted: list[Request] | None) -> list[ScheduledRow]:
        """Prefill rows under the token budget: running requests' next chunks first, then admissions.
        ``preempted`` None: no preemption; the first running request whose pages are short ends the rows (and
        admits nobody: a newcomer never takes pages a running request is waiting for)."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        rows: list[ScheduledRow] = []

        def fits(length: int) -> bool:
            if not rows or cfg.padded_size is None:
                return True
            longest = max([length] + [row.length for row in rows])
            return cfg.padded_size(len(rows) + 1, longest) <= cfg.max_num_batched_tokens

        for request in list(self.running):
            if len(rows) >= cfg.max_prefill_rows or budget <= 0:
                break
            if request.status is RequestStatus.RUNNING and request.pending > 1:
                length = self._chunk(request, budget)
                if not fits(length):
                    break
                if self._allocate(request, length, preempted):
                    budget -= length
                    rows.append(ScheduledRow(request, request.num_computed, length, length == request.pending))
                elif preempted is None:  # nobody was preempted: every row's request still runs
                    return rows
        while self.waiting and len(rows) < cfg.max_prefill_rows and budget > 0:
            if self.num_admitted >= cfg.max_num_seqs:
                break
            request = self.waiting[0]
            hit = self.prefix.match(request) if self.prefix is not None else None
            if hit is not None and self.prefix.should_wait(request, hit, self.running):
                break
            if hit is not None and self.connector is not None:
                started = self._start_load(request, hit)
                if started is None:  # another request is loading this prefix: it will be a local hit
                    break
                if started:
                    continue
            request.num_computed = hit.tokens if hit is not None else 0
            length = self._chunk(request, budget)
            admitted = False
            if fits(length):
                if hit is not None:
                    admitted = self.prefix.admit(request, hit, length)
                else:
                    admitted = self.cache.try_allocate(request.request_id, 0, length)
            if not admitted:  # nothing to preempt for a newcomer: wait for pages
                request.num_computed = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget -= length
            rows.append(ScheduledRow(request, request.num_computed, length, length == request.pending))
        return [row for row in rows if row.request.status is RequestStatus.RUNNING]

    def _start_load(self, request: Request, hit) -> bool | None:
        """Admit the waiting head as LOADING when the connector holds a longer prefix than the local hit and its
        blocks fit (True); False to admit it the usual way; None to wait, when a loading request is already
        loading that prefix (its pages and state become local hits: the same entries are not read twice)."""
        if request.skip_connector:
            return False
        size = self.cache.page_size
        limit = (request.num_tokens - 1) // size
        chain = self.prefix.chain(request, limit)
        pages = self.connector.claim(chain, hit.tokens // size, limit)
        if not pages:
            return False
        for other in self.loading.values():
            if other.load[1] >= pages * size and other.page_hashes[pages - 1] == chain[pages - 1]:
                return None
        if not self.prefix.admit_claim(request, hit, pages * size):
            return False  # no room for the claimed pages now: compute instead of holding the queue
        self.waiting.popleft()
        request.num_computed = hit.tokens
        request.load = (hit.tokens, pages * size)
        request.saved_pages = pages
        request.status = RequestStatus.LOADING
        self.loading[request.request_id] = request
        self.connector.start_load(request.request_id, chain, hit.tokens // size, pages)
        return True

    def finish_load(self, request: Request, tokens: int) -> None:
        """The load of ``request`` ended with its first ``tokens`` tokens in the cache (written by the caller):
        the whole claim: it runs from there; less: it publishes what it has and is queued again at the front
        (its blocks released), to resume from the longest prefix every family holds, recomputing the rest."""
        del self.loading[request.request_id]
        local, claimed = request.load
        request.load = None
        request.num_computed = tokens
        if tokens > local:
            self.prefix.chunk_done(request, tokens)  # publish the loaded pages; snapshot the loaded state
        if tokens == claimed:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            return
        self._release(request)
        request.num_computed = 0
        request.skip_connector = True  # never claimed again: no load loop on a failing store
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def complete(self, step: ScheduledStep, fed: dict | None = None) -> None:
        """Record that the step ran: the fed tokens are now cached. ``fed`` maps a request to the tokens the
        step fed it when that differs from its row's length (a decode row that ran several iterations)."""
        for row in step.rows:
            row.request.num_computed = row.start + (fed or {}).get(row.request, row.length)
            if self.prefix is not None:
                if step.kind == "prefill":
                    self.prefix.chunk_done(row.request, row.start + row.length)
                else:  # sampled tokens are appended after this: they are published on the next call
                    self.prefix.record(row.request)

    def check_invariants(self) -> None:
        self.cache.check_invariants()
        if self.prefix is not None:
            self.prefix.check(self.running)
        if self.num_admitted > self.config.max_num_seqs:
            raise AssertionError(f"{self.num_admitted} running and loading requests > max_num_seqs "
                                 f"{self.config.max_num_seqs}")
        for request in self.loading.values():
            if not self.cache.holds(request.request_id) or request.load is None:
                raise AssertionError(f"loading request {request.request_id!r} holds no blocks or has no load")
            if request.status is not RequestStatus.LOADING:
                raise AssertionError(f"request {request.request_id!r} is loading with status {request.status}")
        for request in self.running:
            if not self.cache.holds(request.request_id) and request.num_computed > 0:
                raise AssertionError(f"running request {request.request_id!r} has cached tokens but no blocks")
        for request in self.waiting:
            if self.cache.holds(request.request_id) or request.num_computed != 0:
                raise AssertionError(f"waiting request {request.request_id!r} holds cache")
