"""Prefix caching for hybrid models: attention pages and recurrent-state snapshots, each at its natural size.
Plain Python.

Identity. A full page of a sequence is named by a hash chain: the hash of page ``j`` covers the hash of page
``j - 1`` and page ``j``'s token ids; the chain starts from a root that covers the placement and page size. So a
hash names a whole prefix, and ``chain[k - 1]`` names the first ``k`` pages.

What is kept.
- Attention (full and each window width): every full, computed page is published in its family's pool under
  its hash (:meth:`PagePool.cache`). When no request references it any more it stays readable on an LRU list
  and is evicted only when the pool runs out of never-cached pages. Pages are shared by refcount, never copied.
- Recurrent layers (GDN, KDA, Mamba): a *snapshot* of every recurrent layer's conv and SSM state, taken after a
  prefill chunk that ends on a page boundary and stored under that boundary's hash, in a pool with its own
  budget (:class:`SnapshotPool`; rows of the state arrays after the slots, at the state's natural size).

A hit for a request is the longest page boundary ``k * page_size`` (leaving at least one token to compute) at
which every family can resume: full attention holds pages ``0 .. k - 1``; a window family holds the pages a
query at ``k * page_size`` still sees; the state family holds a snapshot at ``k`` (``k = 0`` needs nothing).

Where snapshots are taken. The kernels write a sequence's state only at the end of its chunk, so chunks are
cut where snapshots are wanted. With recurrent layers, chunks of a prefill end on page boundaries (the last
chunk ends at the prompt), at multiples of a snapshot interval if one is set, and at *branch points*: where
the request's prefix stops being known (computed before by any request, whether or not its pages are still
cached) and where it stops being shared with a request still queued. Later requests sharing the prefix diverge
there, so the first request past it leaves the snapshot they need: requests submitted together that share a
prefix compute it once, as with attention alone. A waiting request that shares a longer prefix than its hit
with a running request that has not computed that far yet waits for it instead of computing it in parallel.

Device work is queued here and done by the engine before the next step: saves (slot row -> snapshot row) first,
then restores (snapshot row -> slot row); row copies inside the state arrays.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
from typing import TYPE_CHECKING, Hashable, Iterable, Sequence

import numpy as np

from .cache_layout import CacheConfigError
from .cache_manager import CacheManager
from .pools import PoolError, SnapshotPool

if TYPE_CHECKING:
    from .scheduler import Request

HASH_BYTES = 16
# Queued requests a prefill chunk looks at for branch points (bounds the host work per scheduled row).
QUEUE_LOOKAHEAD = 64


def prefix_root(placement: Sequence[str | None], page_size: int) -> bytes:
    """The start of every hash chain: pages computed under another placement or page size never match."""
    return hashlib.blake2b(repr((tuple(placement), page_size)).encode(), digest_size=HASH_BYTES).digest()


def extend_chain(chain: list[bytes], tokens: Sequence[int], page_size: int, pages: int, root: bytes) -> None:
    """Append hashes to ``chain`` until it names the first ``pages`` full pages of ``tokens``."""
    first = len(chain)
    if pages <= first:
        return
    # One conversion for all the new pages: per-page arrays made most of the cost for long prompts.
    data = np.asarray(tokens[first * page_size : pages * page_size], np.int32).tobytes()
    width = 4 * page_size
    for j in range(pages - first):
        h = hashlib.blake2b(chain[-1] if chain else root, digest_size=HASH_BYTES)
        h.update(data[j * width : (j + 1) * width])
        chain.append(h.digest())


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    tokens: int  # cached tokens the request resumes after (a multiple of the page size; 0: a miss)
    pages: dict[str, list[int]]  # family -> cached page ids from ``first_page`` up to the hit
    first_page: dict[str, int]  # family -> first logical page the request still needs
    snapshot: int | None  # snapshot row to restore into the request's state slot
    family_tokens: dict[str, int]  # family -> the longest prefix that family alone holds (for statistics)


@dataclasses.dataclass
class PrefixStats:
    queries: int = 0  # admissions looked up (a preempted request is looked up again when it comes back)
    query_tokens: int = 0  # tokens of those requests at admission
    hit_tokens: int = 0  # tokens not recomputed
    family_hit_tokens: dict = dataclasses.field(default_factory=dict)
    snapshots_saved: int = 0
    snapshots_restored: int = 0

    def hit_rate(self, family: str | None = None) -> float:
        hits = self.hit_tokens if family is None else self.family_hit_tokens.get(family, 0)
        return hits / self.query_tokens if self.query_tokens else 0.0

    def summary(self) -> str:
        families = ", ".join(f"{f} {self.hit_rate(f):.0%}" for f in self.family_hit_tokens)
        return (
            f"prefix cache: {self.hit_tokens} of {self.query_tokens} prompt tokens cached ({self.hit_rate():.0%}); "
            f"per family: {families or 'none'}; {self.snapshots_saved} state snapshots saved, "
            f"{self.snapshots_restored} restored"
        )


class PrefixCache:
    """Hashes, lookups and snapshot bookkeeping over a :class:`CacheManager`'s pools."""

    def __init__(self, manager: CacheManager, root: bytes, snapshot_rows: tuple[int, int] | None = None,
                 known_capacity: int | None = None, stats: PrefixStats | None = None, snapshot_interval: int = 0):
        """``snapshot_rows``: (first row, count) of the snapshot pool in the state arrays; None or a count of 0
        when the placement has no recurrent layer or no room for snapshots. ``snapshot_interval``: prefill
        chunks of recurrent placements also end at its multiples (a multiple of the page size; 0: no such
        ends), so a prefix shared later resumes within one interval of its end even on its second use."""
        if not isinstance(snapshot_interval, int) or snapshot_interval < 0 or snapshot_interval % manager.page_size:
            raise CacheConfigError(
                f"snapshot_interval must be 0 or a multiple of page_size={manager.page_size}, got {snapshot_interval!r}"
            )
        self.snapshot_interval = snapshot_interval
        self.manager = manager
        self.page_size = manager.page_size
        self.root = root
        self.has_state = manager.slots is not None
        self.snapshots = SnapshotPool(*snapshot_rows) if self.has_state and snapshot_rows and snapshot_rows[1] else None
        # Prefixes computed by some request (a bounded LRU set of chain hashes): where they stop is a branch point.
        if known_capacity is None:
            known_capacity = 4 * sum(p.num_pages for p in manager.pools.values()) + 65536
        self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._known_capacity = known_capacity
        self._saves: list[tuple[int, int]] = []  # (slot row, snapshot row)
        self._restores: list[tuple[int, int, Hashable]] = []  # (snapshot row, slot row, request id)
        self.attach_stats(stats if stats is not None else PrefixStats())

    def attach_stats(self, stats: PrefixStats) -> None:
        """Count hits into ``stats`` from now on (every family listed, hit or not)."""
        self.stats = stats
        for family in self.manager.layout.families:
            stats.family_hit_tokens.setdefault(family, 0)

    # ------------------------------------------------------------------------------------------------------------
    def chain(self, request: "Request", pages: int) -> list[bytes]:
        """The request's hash chain, extended to at least ``pages`` full pages of its known tokens."""
        pages = min(pages, request.num_tokens // self.page_size)
        if len(request.page_hashes) < pages:
            prompt = request.prompt_ids
            tokens = prompt if pages * self.page_size <= len(prompt) else prompt + request.output_ids
            extend_chain(request.page_hashes, tokens, self.page_size, pages, self.root)
        return request.page_hashes

    def _last_boundary(self, request: "Request") -> int:
        """The last page boundary a lookup may resume at: at least one token is always left to compute."""
        return (request.num_tokens - 1) // self.page_size

    def hash_ahead(self, requests: Iterable["Request"]) -> None:
        """Extend the hash chains of ``requests`` (queued ones) as far as their admission lookup will read. The
        engine calls this while a step runs on the device: chains are kept on the request, so the lookup then
        finds them computed instead of hashing on the critical path (a 32 x 1024-token prefill hashed ~2.5 ms
        per 8-row step on the host)."""
        for request in requests:
            if request.prefix_cacheable:
                self.chain(request, self._last_boundary(request))

    def _remember(self, key: bytes) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > self._known_capacity:
            self._known.popitem(last=False)

    # ------------------------------------------------------------------------------------------------------------
    def match(self, request: "Request") -> PrefixHit:
        """The longest cached prefix every family can resume from, leaving at least one token to compute."""
        size = self.page_size
        limit = self._last_boundary(request)  # boundaries 0..limit
        chain = self.chain(request, limit)
        valid = np.ones(limit + 1, bool)  # valid[k]: every family can resume at boundary k
        family_best: dict[str, int] = {}
        found: dict[str, list[int | None]] = {}
        for family, pool in self.manager.pools.items():
            window = self.manager.windows[family]
            if window is None:  # full attention: pages 0..k-1, a prefix-closed condition
                pages = []
                for key in chain[:limit]:
                    page = pool.lookup(key)
                    if page is None:
                        break
                    pages.append(page)
                ok = np.arange(limit + 1) <= len(pages)
            else:  # a window: the pages a query at k * size sees, i.e. from (k*size - window + 1) // size
                pages = [pool.lookup(key) for key in chain[:limit]]
                run = np.zeros(limit + 1, np.int64)  # run[k]: present pages ending at page k - 1
                for k in range(1, limit + 1):
                    run[k] = run[k - 1] + 1 if pages[k - 1] is not None else 0
                ks = np.arange(limit + 1)
                ok = run >= ks - np.maximum(0, ks * size - window + 1) // size
            found[family] = pages
            valid &= ok
            family_best[family] = int(np.flatnonzero(ok)[-1]) * size
        rows: list[int | None] = [None] * (limit + 1)
        if self.has_state:
            ok = np.zeros(limit + 1, bool)
            ok[0] = True
            if self.snapshots is not None:
                for k in range(1, limit + 1):
                    rows[k] = self.snapshots.lookup(chain[k - 1])
                    ok[k] = rows[k] is not None
            valid &= ok
            family_best["state"] = int(np.flatnonzero(ok)[-1]) * size
        k = int(np.flatnonzero(valid)[-1])
        first = {f: self.manager.first_visible_page(f, k * size) for f in self.manager.pools}
        pages = {f: [int(p) for p in found[f][first[f] : k]] for f in self.manager.pools}
        return PrefixHit(k * size, pages, first, rows[k] if k else None, family_best)

    def admit(self, request: "Request", hit: PrefixHit, new_tokens: int) -> bool:
        """Allocate a waiting request's blocks starting from ``hit``; queue its state restore. False (nothing
        changed) when a pool is short."""
        if not self.manager.try_allocate(request.request_id, hit.tokens, new_tokens, hit):
            return False
        if hit.snapshot is not None:
            self.snapshots.touch(self.chain(request, hit.tokens // self.page_size)[hit.tokens // self.page_size - 1])
            self._restores.append((hit.snapshot, self.manager.blocks(request.request_id).slot, request.request_id))
            self.stats.snapshots_restored += 1
        request.cached_pages = hit.tokens // self.page_size
        self._count(request, hit)
        return True

    def admit_claim(self, request: "Request", hit: PrefixHit, claim_tokens: int) -> bool:
        """Allocate a waiting request's blocks from ``hit`` up to ``claim_tokens`` (a longer prefix an external
        store will load) and a state slot; no snapshot restore (the load writes the state, and a load that fails
        sends the request back to be admitted again). Window families get every page from the hit on, not just
        those in view at the claim, so a load that stops short still leaves a usable prefix for every family
        (the next allocation drops the pages out of view). False (nothing changed) when a pool is short."""
        if not self.manager.try_allocate(request.request_id, hit.tokens, claim_tokens - hit.tokens, hit):
            return False
        request.cached_pages = hit.tokens // self.page_size
        self._count(request, hit)
        return True

    def _count(self, request: "Request", hit: PrefixHit) -> None:
        self.stats.queries += 1
        self.stats.query_tokens += request.num_tokens
        self.stats.hit_tokens += hit.tokens
        for family, tokens in hit.family_tokens.items():
            self.stats.family_hit_tokens[family] = self.stats.family_hit_tokens.get(family, 0) + tokens

    def _known_run(self, request: "Request", start_page: int, end_page: int) -> int:
        """The last boundary in [start_page, end_page] up to which the request's prefix is known."""
        chain = self.chain(request, end_page)
        k = start_page
        while k < min(end_page, len(chain)) and chain[k] in self._known:
            k += 1
        return k

    def _shared_beyond(self, mine: list[bytes], other: "Request", first: int, pages: int) -> int:
        """How many leading full pages (at most ``pages``) the chain ``mine`` and request ``other`` have in
        common, or 0 when they do not share page ``first`` (one comparison: the common case, unrelated prompts).
        A chain hash names its whole prefix, so sharing page ``k`` means sharing every page before it: a binary
        search."""
        theirs = other.page_hashes
        if len(theirs) <= first:
            theirs = self.chain(other, first + 1)
        if len(mine) <= first or len(theirs) <= first or mine[first] != theirs[first]:
            return 0
        theirs = self.chain(other, pages)
        lo, hi = first + 1, min(pages, len(mine), len(theirs))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mine[mid - 1] == theirs[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _queued_branches(self, request: "Request", waiting: Iterable["Request"], start_page: int,
                         end_page: int) -> set[int]:
        """Boundaries in (start_page, end_page] where the request's prefix stops being shared with a queued
        request (the first ``QUEUE_LOOKAHEAD`` of ``waiting``), or ``end_page`` where it is shared beyond."""
        mine = self.chain(request, end_page)
        shared = (self._shared_beyond(mine, other, start_page, end_page)
                  for other in itertools.islice(waiting, QUEUE_LOOKAHEAD) if other is not request)
        return {k for k in shared if k}

    def chunk_end(self, request: "Request", start: int, end: int, waiting: Iterable["Request"] = ()) -> int:
        """Where a prefill chunk [start, end) should end so that snapshots land where they are useful: at a
        branch point (where the known prefix ends, or where the prefix shared with a queued request in
        ``waiting`` ends) or the next multiple of the snapshot interval inside it, else on a page boundary unless
        it is the last chunk."""
        if not self.has_state or self.snapshots is None:
            return end
        size = self.page_size
        cuts = []
        if start % size == 0:
            cuts.append(self._known_run(request, start // size, end // size) * size)
            cuts += [k * size for k in self._queued_branches(request, waiting, start // size, end // size)]
        if self.snapshot_interval:
            cuts.append((start // self.snapshot_interval + 1) * self.snapshot_interval)
        cuts = [cut for cut in cuts if start < cut < end]
        if cuts:
            return min(cuts)
        if end < request.num_tokens and (end // size) * size > start:
            return (end // size) * size
        return end

    def should_wait(self, request: "Request", hit: PrefixHit, running: Iterable["Request"]) -> bool:
        """True when the request would recompute a prefix that a running request shares and has not computed
        past yet (its chunk ends there: a branch point, see :meth:`chunk_end`): admitting the request one or two
        steps later, from that request's snapshot, turns the recompute into a hit."""
        if not self.has_state or self.snapshots is None:
            return False
        size = self.page_size
        limit = self._last_boundary(request)
        first = hit.tokens // size
        if first >= limit:
            return False  # nothing past the hit that a snapshot could cover
        mine = self.chain(request, limit)
        for other in running:
            if other is request or not other.prefix_cacheable or other.num_computed >= limit * size:
                continue
            if other.num_computed < self._shared_beyond(mine, other, first, limit) * size:
                return True
        return False

    # ------------------------------------------------------------------------------------------------------------
    def record(self, request: "Request") -> None:
        """Publish the request's full, computed pages (and remember their prefixes as known)."""
        if not request.prefix_cacheable or not self.manager.holds(request.request_id):
            return
        done = min(request.num_computed, request.num_tokens) // self.page_size
        if done <= request.cached_pages:
            return
        chain = self.chain(request, done)
        blocks = self.manager.blocks(request.request_id)
        for j in range(request.cached_pages, done):
            self._remember(chain[j])
            for family, table in blocks.tables.items():
                index = j - blocks.first_page[family]
                if 0 <= index < len(table):
                    self.manager.pools[family].cache(table[index], chain[j])
        request.cached_pages = done

    def chunk_done(self, request: "Request", end: int) -> None:
        """A prefill chunk of ``request`` ended at ``end``: publish its pages; snapshot the state on a boundary."""
        self.record(request)
        if self.snapshots is None or not request.prefix_cacheable or end % self.page_size or end == 0:
            return
        key = self.chain(request, end // self.page_size)[end // self.page_size - 1]
        row = self.snapshots.store(key)
        if row is not None:
            self._saves.append((self.manager.blocks(request.request_id).slot, row))
            self.stats.snapshots_saved += 1

    def release(self, request: "Request") -> None:
        """The request is about to give its blocks back (finished, aborted, preempted): publish what it
        computed, and drop a restore queued into its slot (the slot may go to another request this step)."""
        self.record(request)
        self._restores = [r for r in self._restores if r[2] != request.request_id]

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(saves, restores) as (source row, destination row) pairs, to run in that order before the next step."""
        saves, restores = self._saves, [(src, dst) for src, dst, _ in self._restores]
        self._saves, self._restores = [], []
        if self.snapshots is not None:
            self.snapshots.unpin()
        return saves, restores

    # ------------------------------------------------------------------------------------------------------------
    def check(self, requests: Iterable["Request"]) -> None:
        """A request holding a published page holds it at the logical index whose prefix hash names it (no
        request reads pages computed for other tokens); the snapshot pool is consistent."""
        if self.snapshots is not None:
            self.snapshots.check()
        for request in requests:
            if not self.manager.holds(request.request_id):
                continue
            blocks = self.manager.blocks(request.request_id)
            for family, table in blocks.tables.items():
                pool = self.manager.pools[family]
                for index, page in enumerate(table):
                    key = pool.hash_of(page)
                    j = blocks.first_page[family] + index
                    if key is not None and (j >= len(request.page_hashes) or request.page_hashes[j] != key):
                        raise PoolError(
                            f"request {request.request_id!r} holds {family} page {page} at index {j}, but that "
                            f"page is published for another prefix"
                        )
