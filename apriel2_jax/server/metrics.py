"""Server metrics in the Prometheus text exposition format (version 0.0.4), written here rather than with
``prometheus_client``: a handful of counters and histograms do not justify a dependency, and a decode dispatch
yields several tokens at once, which needs a histogram ``observe`` with a count.

Observations come from the engine thread and reads from the event loop, so every update and every render holds
one lock (updates are a few additions; contention is negligible next to a model step).
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
import time
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from .engine_loop import EngineSnapshot

__all__ = ["Histogram", "ServerMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "apriel2"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
RATE_WINDOW_S = 10.0  # tokens/s gauges average over this trailing window


def _num(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
               for k, v in labels.items())
    return "{" + ",".join(escaped) + "}"


class Histogram:
    """Cumulative-bucket histogram; not locked itself (ServerMetrics holds the lock)."""

    def __init__(self, buckets: Iterable[float]):
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count
        self.count += count

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{_num(bound)}"}} {running}')
        out.append(f"{name}_sum {_num(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


class ServerMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests: collections.Counter = collections.Counter()  # finish reason -> count
        self.rejections: collections.Counter = collections.Counter()
        self._recent: collections.deque = collections.deque()  # (time, generated tokens)
        self.started = time.monotonic()

    # Engine thread.
    def admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def inter_token(self, seconds: float, count: int = 1) -> None:
        with self._lock:
            self.itl.observe(seconds, count)

    def generated(self, tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.generation_tokens += tokens
            self._recent.append((now, tokens))
            self._trim(now)

    def finished(self, reason: str, seconds: float) -> None:
        with self._lock:
            self.requests[reason] += 1
            self.e2e.observe(seconds)

    # Event loop.
    def rejected(self, reason: str) -> None:
        with self._lock:
            self.rejections[reason] += 1

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def generation_rate(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S seconds (or since start, if shorter)."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            tokens = sum(n for _, n in self._recent)
        return tokens / min(RATE_WINDOW_S, max(now - self.started, 1e-9))

    def render(self, snapshot: EngineSnapshot, in_flight: int, model_name: str) -> str:
        rate = self.generation_rate()
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: Iterable[tuple[dict, float]]) -> None:
            full = f"{PREFIX}_{name}"
            lines.append(f"# HELP {full} {help_}")
            lines.append(f"# TYPE {full} {kind}")
            for labels, value in samples:
                lines.append(f"{full}{_labels(labels)} {_num(value)}")

        metric("requests_running", "gauge", "Requests in the running batch.", [({}, snapshot.running)])
        metric("requests_waiting", "gauge", "Requests queued in the engine, not yet running.", [({}, snapshot.waiting)])
        metric("requests_in_flight", "gauge", "Requests admitted by the server and not yet answered.",
               [({}, in_flight)])
        usage = sorted(snapshot.cache_usage.items())
        metric("cache_usage_ratio", "gauge", "Fraction of each cache family in use (pages; 'state': slots).",
               [({"family": f}, used / cap if cap else 0.0) for f, (used, cap) in usage])
        metric("cache_used", "gauge", "Pages (slots for 'state') of each cache family in use.",
               [({"family": f}, used) for f, (used, _) in usage])
        metric("cache_capacity", "gauge", "Pages (slots for 'state') of each cache family.",
               [({"family": f}, cap) for f, (_, cap) in usage])
        metric("prefix_cache_hit_rate", "gauge",
               "Share of admitted prompt tokens not recomputed thanks to the prefix cache (all families hit).",
               [({}, snapshot.prefix_hit_rate)])
        metric("prefix_cache_family_hit_rate", "gauge", "Share of admitted prompt tokens each cache family held.",
               [({"family": f}, r) for f, r in sorted(snapshot.prefix_family_hit_rate.items())])
        with self._lock:
            metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [({}, self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Generated tokens.", [({}, self.generation_tokens)])
            metric("requests_finished_total", "counter", "Finished requests by finish reason.",
                   [({"finish_reason": r}, n) for r, n in sorted(self.requests.items())])
            metric("requests_rejected_total", "counter", "Requests refused at admission.",
                   [({"reason": r}, n) for r, n in sorted(self.rejections.items())])
            for name, hist, help_ in (
                ("time_to_first_token_seconds", self.ttft, "Arrival to first generated token."),
                ("inter_token_latency_seconds", self.itl,
                 "Time between generated tokens (a dispatch of several tokens spreads its wait over them)."),
                ("e2e_request_latency_seconds", self.e2e, "Arrival to the last token (or abort)."),
            ):
                full = f"{PREFIX}_{name}"
                lines += [f"# HELP {full} {help_}", f"# TYPE {full} histogram", *hist.lines(full)]
        metric("generation_tokens_per_second", "gauge",
               f"Generated tokens per second over the last {RATE_WINDOW_S:g} s.", [({}, rate)])
        metric("engine_prefill_tokens_per_second", "gauge", "Prefill tokens over prefill step time, since start.",
               [({}, snapshot.prefill_tokens / snapshot.prefill_seconds if snapshot.prefill_seconds else 0.0)])
        metric("engine_decode_tokens_per_second", "gauge", "Decode tokens over decode step time, since start.",
               [({}, snapshot.decode_tokens / snapshot.decode_seconds if snapshot.decode_seconds else 0.0)])
        metric("engine_steps_total", "counter", "Engine dispatches.", [({}, snapshot.steps)])
        metric("engine_preemptions_total", "counter", "Requests preempted for lack of cache.",
               [({}, snapshot.preemptions)])
        metric("model_info", "gauge", "The served model.", [({"model": model_name}, 1)])
        return "\n".join(lines) + "\n"
