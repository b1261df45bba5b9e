"""Host-side id pools: attention pages (one pool per family) and recurrent state slots. Plain Python.

Id 0 of every pool is the sink: it absorbs the writes of padded rows and tokens, and is never allocated,
referenced, or freed.
"""

from __future__ import annotations

from .cache_layout import SINK


class PoolError(RuntimeError):
    """An id was freed twice, freed while unowned, or the sink was touched: a bug, never a clamp."""


class PagePool:
    def __init__(self, name: str, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"page pool {name!r} needs at least 2 pages (one is the sink), got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        # LIFO: recently freed pages are reused first (warm in caches, and easy to reason about in tests).
        self._free = list(range(num_pages - 1, 0, -1))
        self._refs = [0] * num_pages

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.capacity - self.num_free

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise PoolError(f"page pool {self.name!r}: {count} pages asked, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(count)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def retain(self, ids) -> None:
        """One more reference to pages already in use (a shared prefix)."""
        for i in ids:
            if i == SINK or self._refs[i] == 0:
                raise PoolError(f"page pool {self.name!r}: retain of page {i}, which is not in use")
            self._refs[i] += 1

    def release(self, ids) -> None:
        for i in ids:
            if i == SINK or self._refs[i] == 0:
                raise PoolError(f"page pool {self.name!r}: release of page {i}, which is not in use")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def check(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free) or SINK in free:
            raise PoolError(f"page pool {self.name!r}: free list has duplicates or the sink")
        in_use = {i for i in range(1, self.num_pages) if self._refs[i] > 0}
        if free & in_use or len(free) + len(in_use) + 1 != self.num_pages or self._refs[SINK] != 0:
            raise PoolError(f"page pool {self.name!r}: free + in use + sink != capacity")


class SlotPool:
    """Recurrent state slots: one slot id indexes every recurrent layer; each slot has at most one owner."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"state pool needs at least 2 slots (one is the sink), got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))
        self._owner: dict[int, object] = {}

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return len(self._owner)

    def acquire(self, owner: object) -> int:
        if not self._free:
            raise PoolError("state pool: no free slot")
        slot = self._free.pop()
        self._owner[slot] = owner
        return slot

    def release(self, slot: int, owner: object) -> None:
        if self._owner.get(slot) is not owner:
            raise PoolError(f"state pool: release of slot {slot} by a request that does not own it")
        del self._owner[slot]
        self._free.append(slot)

    def owner(self, slot: int) -> object | None:
        return self._owner.get(slot)

    def check(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free) or SINK in free or SINK in self._owner:
            raise PoolError("state pool: free list has duplicates or the sink is in use")
        if free & set(self._owner) or len(free) + len(self._owner) + 1 != self.num_slots:
            raise PoolError("state pool: free + in use + sink != capacity")
