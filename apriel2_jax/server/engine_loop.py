"""The engine thread: the only code that touches the ``LLM`` while the server runs.

The engine's incremental API (``add_request`` / ``step`` / ``abort``) is not thread-safe, and a step blocks for
as long as the device computes, so it cannot run on the asyncio event loop either. One thread owns the engine:

* handlers put commands (add, abort, call) in a thread-safe inbox and never wait on the engine;
* the thread drains the inbox, runs ``llm.step()`` while there is work and hands each step's events to the event
  loop in one ``call_soon_threadsafe`` (each request's tokens go to its asyncio queue as they are produced);
* when idle it blocks on the inbox (no polling);
* if a step raises, every request in flight gets an error (never a hang), their pages and slots are freed, and
  the thread goes on serving.

After every iteration the thread publishes an :class:`EngineSnapshot` (queue lengths, cache use, prefix hit
rate), so ``/metrics`` reads engine state without a lock and without racing the engine.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import threading
import time
import traceback
from typing import Any, Callable

from ..engine.llm import LLM, StreamEvent
from ..engine.sampling import SamplingParams
from .metrics import ServerMetrics

__all__ = ["EngineError", "EngineLoop", "EngineSnapshot", "EngineUnavailable", "QueueFull", "Ticket"]


class QueueFull(Exception):
    """Admission refused: the server already holds as many requests as it may queue (answered 429)."""


class EngineUnavailable(Exception):
    """The engine thread is not running: stopped, or died on a bug (answered 503)."""


@dataclasses.dataclass
class EngineError:
    """Delivered instead of an event when a request fails in the engine. ``status``: 400 (the engine refused the
    prompt), 500 (a step raised) or 503 (the server is shutting down)."""

    status: int
    message: str


class Ticket:
    """One engine request as the event loop sees it. Its events (or an :class:`EngineError`) are put on ``queue``
    as ``(tag, item, logprobs)``, ``logprobs`` being the new tokens' log-probabilities when the request asked for
    them; several tickets of one HTTP request share a queue and tell themselves apart by ``tag``."""

    __slots__ = ("prompt_ids", "params", "queue", "tag", "arrival", "request_id", "done", "closed",
                 "first_token_at", "last_token_at", "tokens")

    def __init__(self, prompt_ids: list[int], params: SamplingParams, queue: asyncio.Queue, tag: Any):
        self.prompt_ids = prompt_ids
        self.params = params
        self.queue = queue
        self.tag = tag
        self.arrival = time.monotonic()
        self.request_id: int | None = None  # set by the engine thread
        self.done = False  # the engine delivered its last item (set on the event loop)
        self.closed = False  # the handler let go of it (set on the event loop)
        # Engine-thread timing for the latency histograms.
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.tokens = 0


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    running: int = 0
    waiting: int = 0
    cache_usage: dict = dataclasses.field(default_factory=dict)  # family -> (used, capacity)
    prefix_hit_rate: float = 0.0
    prefix_family_hit_rate: dict = dataclasses.field(default_factory=dict)
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    preemptions: int = 0
    steps: int = 0


@dataclasses.dataclass
class _Add:
    ticket: Ticket


@dataclasses.dataclass
class _Abort:
    ticket: Ticket


@dataclasses.dataclass
class _Call:
    fn: Callable[[LLM], Any]
    future: concurrent.futures.Future


class _Stop:
    pass


class EngineLoop:
    """Runs ``llm`` on its own thread for an asyncio server. Create and use the handles (``submit``, ``close``)
    on the event loop given to :meth:`start`."""

    def __init__(self, llm: LLM, *, max_queued_requests: int, metrics: ServerMetrics | None = None,
                 log: Callable[[str], None] | None = None):
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.llm = llm
        # Requests in flight beyond the running batch that may wait in the engine's queue.
        self.max_in_flight = llm.scheduler_config.max_num_seqs + max_queued_requests
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.log = log if log is not None else llm.log
        self.in_flight = 0  # tickets submitted and not yet closed (event-loop side only)
        self.snapshot = EngineSnapshot()
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._live: dict[int, Ticket] = {}  # engine request id -> ticket (engine thread only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False
        self.failed: str | None = None  # why the engine thread died, if it did

    # -- event-loop side ---------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="apriel2-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Let the thread finish its current step, fail what is in flight (503) and exit."""
        if self._thread is None:
            return
        self._put(_Stop())
        self._thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._accepting and self._thread is not None and self._thread.is_alive()

    def submit(self, prompts: list[list[int]], params: SamplingParams, queue: asyncio.Queue) -> list[Ticket]:
        """Queue one engine request per prompt (all or none), tagged 0, 1, ... Raises :class:`QueueFull` when
        admitting them would exceed the limit. Every ticket must be :meth:`close`-d."""
        if not self._accepting:
            raise EngineUnavailable(f"the engine is not running ({self.failed or 'stopped'})")
        if self.in_flight + len(prompts) > self.max_in_flight:
            self.metrics.rejected("queue_full")
            raise QueueFull(f"the server holds {self.in_flight} requests, its limit is {self.max_in_flight} "
                            f"(max_num_seqs + max_queued_requests); retry later")
        tickets = [Ticket(ids, params, queue, tag) for tag, ids in enumerate(prompts)]
        self.in_flight += len(tickets)
        for ticket in tickets:
            if not self._put(_Add(ticket)):  # stopped since the check: answer here, nothing will
                self._deliver([(ticket, EngineError(503, f"the engine is not running ({self.failed or 'stopped'})"))])
        return tickets

    def close(self, ticket: Ticket) -> None:
        """The handler is done with ``ticket``: abort it in the engine if it is still running (the client went
        away or stopped reading) and release its admission. Idempotent."""
        if ticket.closed:
            return
        ticket.closed = True
        self.in_flight -= 1
        if not ticket.done:
            self._put(_Abort(ticket))

    def call(self, fn: Callable[[LLM], Any]) -> concurrent.futures.Future:
        """Run ``fn(llm)`` on the engine thread between steps (tests, maintenance); its result as a future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self._put(_Call(fn, future)):
            future.cancel()
        return future

    def _put(self, command) -> bool:
        """False once the thread has stopped taking commands (shut down or died)."""
        with self._wake:
            if not self._accepting:
                return False
            self._inbox.append(command)
            self._wake.notify()
            return True

    def _deliver(self, items: list[tuple]) -> None:
        """On the event loop: hand a step's items to their requests' queues."""
        for ticket, item, *logprobs in items:
            if isinstance(item, EngineError) or (isinstance(item, StreamEvent) and item.finished):
                ticket.done = True
            if not ticket.closed:
                ticket.queue.put_nowait((ticket.tag, item, logprobs[0] if logprobs else None))

    # -- engine thread -----------------------------------------------------------------------------------------
    def _take(self, block: bool) -> list:
        with self._wake:
            while block and not self._inbox:
                self._wake.wait()
            commands = list(self._inbox)
            self._inbox.clear()
        return commands

    def _run(self) -> None:
        llm = self.llm
        try:
            while True:
                out: list[tuple[Ticket, Any]] = []
                commands = self._take(block=not llm.has_unfinished_requests)
                for i, command in enumerate(commands):
                    if isinstance(command, _Stop):
                        self._shutdown(out, commands[i + 1:], 503, "the server is shutting down")
                        return
                    self._handle(command, out)
                if llm.has_unfinished_requests:
                    try:
                        events = llm.step()
                    except Exception as err:  # noqa: BLE001 - any engine failure must reach its requests
                        self.log(f"engine step failed; failing {len(self._live)} requests:\n{traceback.format_exc()}")
                        self._fail_live(out, 500, f"the engine failed while running this request: "
                                                  f"{type(err).__name__}: {err}")
                    else:
                        self._route(events, out)
                self._send(out)
                self._publish()
        except BaseException as err:  # the thread itself broke (a bug): make the server unhealthy, say why
            self.failed = f"{type(err).__name__}: {err}"
            self.log(f"engine thread died:\n{traceback.format_exc()}")
            self._shutdown([], [], 503, f"the engine stopped: {self.failed}", abort=False)

    def _shutdown(self, out: list, unhandled: list, status: int, message: str, abort: bool = True) -> None:
        """Refuse further commands and fail everything in flight or still queued, so no request hangs."""
        with self._wake:
            self._accepting = False
            unhandled = unhandled + list(self._inbox)
            self._inbox.clear()
        self._fail_live(out, status, message, abort)
        out += [(c.ticket, EngineError(status, message)) for c in unhandled if isinstance(c, _Add)]
        for c in unhandled:
            if isinstance(c, _Call):
                c.future.cancel()
        self._send(out)

    def _handle(self, command, out: list) -> None:
        llm = self.llm
        if isinstance(command, _Add):
            ticket = command.ticket
            if ticket.closed:  # the client left before the engine saw the request
                return
            try:
                ticket.request_id = llm.add_request(ticket.prompt_ids, ticket.params)
            except ValueError as err:  # the handler checks prompts first; this is the engine's last word
                out.append((ticket, EngineError(400, str(err))))
                return
            self._live[ticket.request_id] = ticket
            self.metrics.admitted(len(ticket.prompt_ids))
        elif isinstance(command, _Abort):
            ticket = command.ticket
            if ticket.request_id is not None and self._live.pop(ticket.request_id, None) is not None:
                llm.abort(ticket.request_id)
                self.metrics.finished("abort", time.monotonic() - ticket.arrival)
        elif isinstance(command, _Call):
            if command.future.set_running_or_notify_cancel():
                try:
                    command.future.set_result(command.fn(llm))
                except BaseException as err:  # noqa: BLE001 - handed to the caller
                    command.future.set_exception(err)

    def _route(self, events: list[StreamEvent], out: list) -> None:
        now = time.monotonic()
        for event in events:
            ticket = self._live.get(event.index)
            if ticket is None:  # aborted in this iteration, after the step produced it
                continue
            n = len(event.new_token_ids)
            logprobs = event.new_logprobs if ticket.params.logprobs else None
            if n:
                if ticket.first_token_at is None:
                    ticket.first_token_at = now
                    self.metrics.first_token(now - ticket.arrival)
                    if n > 1:
                        self.metrics.inter_token(0.0, n - 1)
                else:
                    # A decode dispatch yields several tokens at once: spread its wait over them.
                    self.metrics.inter_token((now - ticket.last_token_at) / n, n)
                ticket.last_token_at = now
                ticket.tokens += n
                self.metrics.generated(n)
            if event.finished:
                del self._live[event.index]
                self.metrics.finished(event.output.finish_reason, now - ticket.arrival)
            out.append((ticket, event, logprobs))

    def _fail_live(self, out: list, status: int, message: str, abort: bool = True) -> None:
        for request_id, ticket in list(self._live.items()):
            if abort:
                try:
                    self.llm.abort(request_id)
                except Exception:  # noqa: BLE001 - keep failing the others; the log has the first error
                    self.log(f"abort of request {request_id} failed:\n{traceback.format_exc()}")
            self.metrics.finished("error", time.monotonic() - ticket.arrival)
            out.append((ticket, EngineError(status, message)))
        self._live.clear()

    def _send(self, out: list) -> None:
        if out and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._deliver, out)
            except RuntimeError:  # the loop closed in between: nobody is waiting any more
                pass

    def _publish(self) -> None:
        llm = self.llm
        stats = llm.stats
        prefix = stats.prefix
        self.snapshot = EngineSnapshot(
            running=len(llm.scheduler.running),
            waiting=len(llm.scheduler.waiting),
            cache_usage=dict(llm.cache_manager.usage()),
            prefix_hit_rate=prefix.hit_rate(),
            prefix_family_hit_rate={f: prefix.hit_rate(f) for f in llm.layout.families} if llm.prefix_cache else {},
            prefill_tokens=stats.prefill_tokens,
            prefill_seconds=stats.prefill_seconds,
            decode_tokens=stats.decode_tokens,
            decode_seconds=stats.decode_seconds,
            preemptions=stats.preemptions,
            steps=stats.steps,
        )
