"""The connector the engine calls: how much of a prefix a store holds, asynchronous loads of it, and saves of
what prefill computed. Plain Python + numpy: store reads and writes run on daemon worker threads; the engine
supplies the device side (``transfer.py``: gathers for saves, a ``stage`` copy of loaded arrays to the device).

A *claim* is page-aligned and ends where the store holds a state entry (placements with recurrent layers): page
entries ``local .. k - 1`` (the pages before ``local`` are in the device prefix cache) and the state entry at
``k``. A load reads them in order and stops at the first entry it cannot return intact (missing, corrupt, of
the wrong shape or dtype); its result names the last *good boundary*: every page before it read and, with
recurrent layers, a state entry at it (the claimed one, else the nearest earlier one the store holds). A load
past its deadline is abandoned (its result ignored when it comes) and reported at the claim's start. Entries
that failed are remembered and never claimed again, so a request cannot be re-claimed in a loop.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Callable, Hashable, Sequence

import numpy as np

from .base import ConnectorError, Entry, EntryStore


@dataclasses.dataclass
class ConnectorStats:
    lookups: int = 0  # admissions that asked the store
    loads: int = 0  # loads started (claims)
    tokens_claimed: int = 0
    tokens_loaded: int = 0  # prefix tokens written into the device caches from the store
    tokens_saved: int = 0  # page entries written, in tokens
    state_entries_saved: int = 0
    failed_loads: int = 0  # loads that stopped short of their claim (missing, corrupt, timed out)
    timeouts: int = 0
    failed_saves: int = 0
    load_seconds: float = 0.0  # worker time of the loads that came back (store reads and the ``stage`` copy)
    stage_seconds: float = 0.0  # of which the ``stage`` copy (to the device)

    def summary(self) -> str:
        return (
            f"kv connector: {self.tokens_loaded} of {self.tokens_claimed} claimed prefix tokens loaded "
            f"({self.loads} loads, {self.failed_loads} failed, {self.timeouts} timed out); {self.tokens_saved} "
            f"tokens and {self.state_entries_saved} state snapshots saved"
            + (f"; {self.failed_saves} saves failed" if self.failed_saves else "")
        )


@dataclasses.dataclass(frozen=True)
class LoadResult:
    request_id: Hashable
    first_page: int  # the claim's first page (pages before it were local)
    claimed_pages: int  # the claim ends at this many pages
    good_pages: int  # the last good boundary (first_page: nothing usable)
    # page array name -> rows [>= good_pages - first_page, ...] (row i: page first_page + i; rows past the good
    # ones are zeros), staged (on the device) when the connector has a ``stage`` function
    pages: dict
    state: dict | None  # state array name -> row [1, ...] at good_pages (None: none loaded)
    error: str | None = None
    stage_seconds: float = 0.0  # time the ``stage`` copy took

    @property
    def complete(self) -> bool:
        return self.good_pages == self.claimed_pages


@dataclasses.dataclass
class _Load:
    request_id: Hashable
    chain: list[bytes]
    first_page: int
    pages: int
    deadline: float
    result: LoadResult | None = None


class KVConnector:
    def __init__(self, store: EntryStore, load_timeout: float = 30.0, load_workers: int = 2, read_threads: int = 8,
                 stage: Callable[[dict], dict] | None = None, log: Callable[[str], None] | None = None):
        """``read_threads``: entries of one load are read by this many threads when the store's
        ``parallel_reads`` allows it (file reads and checksums release the GIL). ``stage``: applied on the load
        worker to the loaded arrays (e.g. a copy to the device, so the engine loop does not wait for it). It must
        return copies, complete when it returns: with it, loads reuse the host buffers of earlier loads (first
        touches of fresh pages, not the copies, dominated the read time of an 8K-token prefix)."""
        if not load_timeout > 0:
            raise ValueError(f"kv load timeout must be > 0 seconds, got {load_timeout!r}")
        self.store = store
        self.read_threads = max(1, read_threads)
        self.stage = stage
        self._free_buffers: list[dict[str, np.ndarray]] = []  # host buffer sets of finished loads (``stage`` only)
        self.load_timeout = load_timeout
        self.log = log or (lambda msg: None)
        self.stats = ConnectorStats()
        self.has_state = False
        self.page_size = 0
        self._page_specs: dict[str, tuple] = {}
        self._state_specs: dict[str, tuple] = {}
        self._bad: set[tuple[str, bytes]] = set()  # entries that failed to load: never claimed again
        self._lock = threading.Condition()
        self._loads: dict[Hashable, _Load] = {}
        self._load_queue: queue.Queue = queue.Queue()
        self._save_queue: queue.Queue = queue.Queue()
        for i in range(load_workers):
            threading.Thread(target=self._load_worker, name=f"kv-load-{i}", daemon=True).start()
        threading.Thread(target=self._save_worker, name="kv-save", daemon=True).start()

    def configure(self, page_size: int, page_specs: dict[str, tuple], state_specs: dict[str, tuple]) -> None:
        """The page size and the arrays an entry must carry under the current placement: name -> (row shape,
        dtype). A new placement may come only with no load in flight."""
        if self._loads:
            raise RuntimeError("cannot reconfigure the kv connector while loads are in flight")
        self.page_size = page_size
        self._page_specs = dict(page_specs)
        self._state_specs = dict(state_specs)
        self.has_state = bool(state_specs)

    # ------------------------------------------------------------------------------------------------------------
    def _holds(self, kind: str, key: bytes) -> bool:
        return (kind, key) not in self._bad and self.store.contains(kind, key)

    def claim(self, chain: Sequence[bytes], local_pages: int, limit_pages: int) -> int:
        """Pages of the longest prefix (at most ``limit_pages``) the store can add to ``local_pages`` already
        cached: the claim's end, or 0 when the store adds nothing."""
        self.stats.lookups += 1
        best = 0
        for k in range(local_pages + 1, limit_pages + 1):
            if not self._holds("page", chain[k - 1]):
                break
            if not self.has_state or self._holds("state", chain[k - 1]):
                best = k
        return best

    def start_load(self, request_id: Hashable, chain: Sequence[bytes], first_page: int, pages: int) -> None:
        """Read page entries ``first_page .. pages - 1`` and the state entry at ``pages`` on a worker."""
        load = _Load(request_id, list(chain[:pages]), first_page, pages, time.monotonic() + self.load_timeout)
        with self._lock:
            if request_id in self._loads:
                raise RuntimeError(f"request {request_id!r} already has a load in flight")
            self._loads[request_id] = load
        self.stats.loads += 1
        self.stats.tokens_claimed += (pages - first_page) * self.page_size
        self._load_queue.put(load)

    def cancel(self, request_id: Hashable) -> None:
        """Forget a load (its request was aborted): its result is dropped when it comes."""
        with self._lock:
            self._loads.pop(request_id, None)

    @property
    def in_flight(self) -> int:
        return len(self._loads)

    def poll(self) -> list[LoadResult]:
        """Loads that finished, and loads past their deadline (reported with nothing loaded)."""
        now = time.monotonic()
        done = []
        with self._lock:
            for request_id, load in list(self._loads.items()):
                if load.result is not None:
                    done.append(load.result)
                elif now > load.deadline:
                    self.stats.timeouts += 1
                    self.log(f"kv connector: load of request {request_id!r} timed out after {self.load_timeout:g} s; "
                             f"recomputing its prefix")
                    done.append(LoadResult(request_id, load.first_page, load.pages, load.first_page, {}, None,
                                           f"timed out after {self.load_timeout:g} s"))
                else:
                    continue
                del self._loads[request_id]
        for result in done:
            if not result.complete:
                self.stats.failed_loads += 1
        return done

    def wait(self, timeout: float) -> None:
        """Block until a load finishes or ``timeout`` seconds pass (the engine has nothing else to run)."""
        with self._lock:
            if not any(load.result is not None for load in self._loads.values()):
                deadline = min((load.deadline for load in self._loads.values()), default=time.monotonic())
                self._lock.wait(max(0.0, min(timeout, deadline - time.monotonic())))

    # ------------------------------------------------------------------------------------------------------------
    def _read(self, kind: str, key: bytes, specs: dict[str, tuple]) -> dict[str, np.ndarray]:
        entry = self.store.get(kind, key)
        if set(entry.arrays) != set(specs):
            raise ConnectorError(f"{kind} entry {key.hex()} carries {sorted(entry.arrays)[:4]}..., not this "
                                 f"placement's arrays")
        for name, (shape, dtype) in specs.items():
            array = entry.arrays[name]
            if tuple(array.shape) != tuple(shape) or array.dtype != dtype:
                raise ConnectorError(f"{kind} entry {key.hex()}: {name} is {array.dtype}{list(array.shape)}, "
                                     f"expected {np.dtype(dtype)}{list(shape)}")
        return entry.arrays

    def _load_worker(self) -> None:
        while True:
            load = self._load_queue.get()
            with self._lock:
                if self._loads.get(load.request_id) is not load:
                    continue  # cancelled or timed out while queued
            start = time.monotonic()
            result = self._run_load(load)
            with self._lock:
                if self._loads.get(load.request_id) is load:
                    load.result = result
                    self.stats.load_seconds += time.monotonic() - start
                    self.stats.stage_seconds += result.stage_seconds
                    self._lock.notify_all()

    def _fail(self, kind: str, key: bytes, err: Exception) -> str:
        self._bad.add((kind, key))
        return f"{kind} entry {key.hex()}: {err}"

    def _read_pages(self, load: _Load) -> tuple[dict[str, np.ndarray], int, str | None]:
        """Page entries ``first_page .. pages - 1`` read by several threads into one buffer per array name
        (rows padded with zeros to a power of two, the shape the device copy compiles for): (buffers, pages
        read intact from the start, the first error)."""
        count = load.pages - load.first_page
        rows = 1 << max(0, count - 1).bit_length()
        buffers = self._take_buffers(rows, count)
        ok = np.zeros(count, bool)
        errors: dict[int, str] = {}
        first_bad = [count]  # a failed page ends the load there: pages after it are not read
        lock = threading.Lock()

        def read(indices: range) -> None:
            for i in indices:
                if i > first_bad[0]:
                    return
                key = load.chain[load.first_page + i]
                try:
                    arrays = self._read("page", key, self._page_specs)
                    for name, array in arrays.items():
                        buffers[name][i] = array
                    ok[i] = True
                except Exception as err:  # a store may fail in any way; the engine must not
                    with lock:
                        errors[i] = self._fail("page", key, err)
                        first_bad[0] = min(first_bad[0], i)
                    return

        threads = max(1, min(self.read_threads if self.store.parallel_reads else 1, count))
        step = -(-count // threads)
        workers = [threading.Thread(target=read, args=(range(t * step, min(count, (t + 1) * step)),), daemon=True)
                   for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        good = int(np.argmin(ok)) if not ok.all() else count
        error = errors[min(errors)] if errors else None
        return buffers, good, error

    def _take_buffers(self, rows: int, count: int) -> dict[str, np.ndarray]:
        """[rows, *shape] buffers per page array name whose rows from ``count`` on are zeros (they are written
        to the sink): the most recently returned set when it is large enough, else new arrays."""
        specs = self._page_specs
        with self._lock:
            held = self._free_buffers.pop() if self._free_buffers else None
        if held is None or set(held) != set(specs) or any(
                held[n].shape[0] < rows or held[n].shape[1:] != tuple(shape) or held[n].dtype != dtype
                for n, (shape, dtype) in specs.items()):
            return {name: np.zeros((rows,) + tuple(shape), dtype) for name, (shape, dtype) in specs.items()}
        for buffer in held.values():
            buffer[count:rows] = 0
        return {name: buffer[:rows] for name, buffer in held.items()}

    def _give_back(self, buffers: dict[str, np.ndarray]) -> None:
        bases = {name: (b.base if b.base is not None else b) for name, b in buffers.items()}
        with self._lock:
            self._free_buffers.append(bases)
            del self._free_buffers[:-2]  # at most two sets kept

    def _run_load(self, load: _Load) -> LoadResult:
        buffers, read, error = self._read_pages(load)
        good = load.first_page + read
        state = None
        if self.has_state:  # the claimed state entry, else the nearest earlier one the store holds
            boundary = load.first_page
            for k in range(good, load.first_page, -1):
                key = load.chain[k - 1]
                if k != load.pages and not self._holds("state", key):
                    continue
                try:
                    state = {n: a[None] for n, a in self._read("state", key, self._state_specs).items()}
                    boundary = k
                    break
                except Exception as err:
                    error = error or self._fail("state", key, err)
            good = boundary
        if error:
            self.log(f"kv connector: load of request {load.request_id!r} stopped at page {good} of "
                     f"{load.pages}: {error}")
        pages = buffers if good > load.first_page else {}
        staged = time.monotonic()
        if self.stage is not None:
            pages, state = self.stage(pages), (None if state is None else self.stage(state))
            self._give_back(buffers)  # the stage copied them: the next load may reuse them
        return LoadResult(load.request_id, load.first_page, load.pages, good, pages, state, error,
                          time.monotonic() - staged)

    # ------------------------------------------------------------------------------------------------------------
    def save(self, build: Callable[[], list[Entry]]) -> None:
        """Queue a save: ``build`` runs on the save worker (it may wait for device copies) and returns the
        entries to put. Saves run in order; a failing store is counted and logged, never raised."""
        self._save_queue.put(build)

    def _save_worker(self) -> None:
        while True:
            build = self._save_queue.get()
            try:
                for entry in build():
                    self.store.put(entry)
                    self._bad.discard(entry.id)
                    if entry.kind == "page":
                        self.stats.tokens_saved += self.page_size
                    else:
                        self.stats.state_entries_saved += 1
            except Exception as err:
                self.stats.failed_saves += 1
                self.log(f"kv connector: a save to the {self.store.name} store failed: {err}")
            finally:
                self._save_queue.task_done()

    def flush(self) -> None:
        """Wait until every queued save is in the store."""
        self._save_queue.join()

    def contains(self, kind: str, key: bytes) -> bool:
        return self.store.contains(kind, key)
