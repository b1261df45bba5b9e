"""Per-request cache bookkeeping over the pools: block tables per family, one state slot. Plain Python + numpy.

Window families keep only the pages a request can still see: before each allocation, pages that lie wholly
before ``computed - window + 1`` (the oldest position the next chunk's queries attend to) are released, so a
window request holds at most ``window_table_width`` pages however long it runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Hashable, Sequence

import numpy as np

from .cache_layout import SINK, CacheLayout, CachePlan
from .pools import PagePool, PoolError, SlotPool

if TYPE_CHECKING:
    from .prefix_cache import PrefixHit


@dataclasses.dataclass
class RequestBlocks:
    tables: dict[str, list[int]]  # family -> page ids, by logical page index starting at first_page
    first_page: dict[str, int]
    slot: int = SINK


# A decode step's block tables span the widest row's pages, rounded up to a half-octave width (a power of two or
# 1.5 times one) of at least this many tokens, not max_model_len: the decode attention kernel sizes its K-splits
# (and the merge of their partials) by the table's span. With full-width tables, the 0.5B geometry's default
# max_model_len (262144) made an all-attention decode step at context 1024 and one row take 0.87 ms, fitted 0.72
# (H200, 2026-11-27; docs/BENCHMARKS.md). Half-octave steps keep the span within 1.5x the context, so the kernel's
# splits hold ~85-128 context tokens, and bound the decode shapes compiled to ~2 log2(max_model_len / this).
MIN_FITTED_TABLE_TOKENS = 1024


def fitted_table_width(pages: int, full_width: int, page_size: int) -> int:
    """The block-table width for a step whose widest row holds ``pages`` pages: the smallest power of two, or 1.5
    times one, at least that and ``MIN_FITTED_TABLE_TOKENS`` tokens' worth, capped at ``full_width`` (the family's
    widest table)."""
    want = max(pages, -(-MIN_FITTED_TABLE_TOKENS // page_size), 1)
    octave = 1 << (want - 1).bit_length()
    if octave >= 4 and want <= 3 * octave // 4:
        octave = 3 * octave // 4
    return min(octave, full_width)


@dataclasses.dataclass(frozen=True)
class StepTables:
    """Everything the jitted step reads from the manager, for all layers at once."""

    tables: dict[str, np.ndarray]  # family -> [rows, width] int32
    first_page: dict[str, np.ndarray]  # family -> [rows] int32
    slots: np.ndarray  # [rows] int32


class CacheManager:
    def __init__(self, layout: CacheLayout, plan: CachePlan):
        self.layout = layout
        self.plan = plan
        self.page_size = plan.page_size
        self.pools = {fam.key: PagePool(fam.key, plan.pages[fam.key]) for fam in layout.attention}
        self.windows = {fam.key: fam.window for fam in layout.attention}
        self.slots = SlotPool(plan.slots) if layout.state else None
        self._requests: dict[Hashable, RequestBlocks] = {}
        self.metadata_builds = 0  # one per step, never one per layer (see tests/engine)

    # ------------------------------------------------------------------------------------------------------------
    def first_visible_page(self, family: str, computed: int) -> int:
        """First logical page the next chunk (starting at position ``computed``) can attend to."""
        window = self.windows[family]
        if window is None:
            return 0
        return max(0, computed - window + 1) // self.page_size

    def try_allocate(self, request_id: Hashable, computed: int, new_tokens: int, hit: "PrefixHit | None" = None) -> bool:
        """Make room for positions [computed, computed + new_tokens). All or nothing across families: returns
        False (and allocates nothing) when a pool is short, so the caller can preempt and retry. ``hit``: a
        request not yet holding blocks starts from these cached pages (``computed`` is then the hit length)."""
        blocks = self._requests.get(request_id)
        reviving = {f: 0 for f in self.pools}  # cached pages of the hit that nobody references: no longer free
        if blocks is None:
            if hit is not None:
                blocks = RequestBlocks({f: list(hit.pages[f]) for f in self.pools}, dict(hit.first_page))
                reviving = {f: sum(map(self.pools[f].is_evictable, hit.pages[f])) for f in self.pools}
            else:
                blocks = RequestBlocks({f: [] for f in self.pools}, {f: 0 for f in self.pools})
            fresh = True
        else:
            fresh = False
        for family, pool in self.pools.items():
            first = self.first_visible_page(family, computed)
            drop = min(first - blocks.first_page[family], len(blocks.tables[family]))
            if drop > 0:
                table = blocks.tables[family]
                pool.release(table[:drop])
                del table[:drop]
                blocks.first_page[family] += drop
            if not blocks.tables[family]:  # nothing held: start at the first page still visible
                blocks.first_page[family] = max(blocks.first_page[family], first)
        end_page = math.ceil((computed + new_tokens) / self.page_size)
        needed = {
            family: max(0, end_page - blocks.first_page[family] - len(blocks.tables[family])) for family in self.pools
        }
        if any(needed[f] + reviving[f] > self.pools[f].num_free for f in self.pools):
            return False
        needs_slot = self.slots is not None and blocks.slot == SINK
        if needs_slot and self.slots.num_free == 0:
            return False
        if fresh:
            for family, table in blocks.tables.items():
                self.pools[family].retain(table)
            self._requests[request_id] = blocks
        for family, count in needed.items():
            if count:
                blocks.tables[family].extend(self.pools[family].allocate(count))
        if needs_slot:
            blocks.slot = self.slots.acquire(request_id)
        return True

    def free(self, request_id: Hashable) -> None:
        """Release every page and the slot of a request (finished, aborted or preempted). Pages go last-first,
        so cached ones are evicted tail before prefix."""
        blocks = self._requests.pop(request_id, None)
        if blocks is None:
            return
        for family, table in blocks.tables.items():
            self.pools[family].release(reversed(table))
        if blocks.slot != SINK:
            self.slots.release(blocks.slot, request_id)

    def holds(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def blocks(self, request_id: Hashable) -> RequestBlocks:
        return self._requests[request_id]

    # ------------------------------------------------------------------------------------------------------------
    def build_step_tables(self, request_ids: Sequence[Hashable | None], rows: int, fit: bool = False) -> StepTables:
        """Block tables, first pages and slots for the rows of one step (None or missing rows are padding:
        sink tables, sink slot). Built once per step and shared by every layer. ``fit``: each family's tables are
        ``fitted_table_width`` wide for its widest row (else the family's full width)."""
        self.metadata_builds += 1
        widths = dict(self.plan.table_width)
        if fit:
            for family in self.pools:
                most = max((len(self._requests[r].tables[family]) for r in request_ids if r is not None), default=0)
                widths[family] = fitted_table_width(most, widths[family], self.plan.page_size)
        tables = {f: np.zeros((rows, widths[f]), np.int32) for f in self.pools}
        first = {f: np.zeros((rows,), np.int32) for f in self.pools}
        slots = np.zeros((rows,), np.int32)
        for row, request_id in enumerate(request_ids):
            if request_id is None:
                continue
            blocks = self._requests[request_id]
            for family, table in blocks.tables.items():
                if len(table) > tables[family].shape[1]:
                    raise PoolError(
                        f"request {request_id!r} holds {len(table)} pages of {family}, more than the table width "
                        f"{tables[family].shape[1]}"
                    )
                tables[family][row, : len(table)] = table
                first[family][row] = blocks.first_page[family]
            slots[row] = blocks.slot
        return StepTables(tables, first, slots)

    # ------------------------------------------------------------------------------------------------------------
    def usage(self) -> dict[str, tuple[int, int]]:
        """family -> (in use, capacity), pages for attention families and slots for "state"."""
        out = {f: (p.num_in_use, p.capacity) for f, p in self.pools.items()}
        if self.slots is not None:
            out["state"] = (self.slots.num_in_use, self.slots.capacity)
        return out

    def check_invariants(self) -> None:
        """free + in use + sink == capacity per pool; refcounts equal the block tables' references; no slot
        shared; every table id belongs to its own family's range."""
        for family, pool in self.pools.items():
            pool.check()
            counts = np.zeros(pool.num_pages, np.int64)
            for request_id, blocks in self._requests.items():
                table = blocks.tables[family]
                if any(not (0 < page < pool.num_pages) for page in table):
                    raise PoolError(f"request {request_id!r}: {family} table holds an id outside the pool")
                np.add.at(counts, table, 1)
            for page in range(1, pool.num_pages):
                if counts[page] != pool.refcount(page):
                    raise PoolError(
                        f"{family} page {page}: refcount {pool.refcount(page)}, referenced {counts[page]} times"
                    )
        if self.slots is not None:
            self.slots.check()
            seen: dict[int, Hashable] = {}
            for request_id, blocks in self._requests.items():
                if blocks.slot == SINK:
                    continue
                if blocks.slot in seen:
                    raise PoolError(f"slot {blocks.slot} shared by {seen[blocks.slot]!r} and {request_id!r}")
                if self.slots.owner(blocks.slot) != request_id:
                    raise PoolError(f"slot {blocks.slot} is not owned by {request_id!r}")
                seen[blocks.slot] = request_id
            if len(seen) != self.slots.num_in_use:
                raise PoolError("a state slot is in use but no request holds it")
