"""Host-side id pools: attention pages (one pool per family) and recurrent state slots. Plain Python.

Id 0 of every pool is the sink: it absorbs the writes of padded rows and tokens, and is never allocated,
referenced, or freed.
"""

from __future__ import annotations

from .cache_layout import SINK


class PoolError(RuntimeError):
    """An id was freed twice, freed while unowned, or the sink was touched: a bug, never a clamp."""


class _IdPool:
    """A LIFO free list over ids 1..size-1 (recently freed ids are reused first); id 0 is the sink."""

    kind = "pool"

    def __init__(self, name: str, size: int):
        if size < 2:
            raise ValueError(f"{self.kind} {name!r} needs at least 2 ids (one is the sink), got {size}")
        self.name = name
        self.size = size
        self._free = list(range(size - 1, 0, -1))

    @property
    def capacity(self) -> int:
        return self.size - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.capacity - self.num_free

    def _check_free_list(self, in_use: set[int]) -> None:
        free = set(self._free)
        if len(free) != len(self._free) or SINK in free or SINK in in_use:
            raise PoolError(f"{self.kind} {self.name!r}: free list has duplicates, or the sink is listed")
        if free & in_use or len(free) + len(in_use) + 1 != self.size:
            raise PoolError(f"{self.kind} {self.name!r}: free + in use + sink != capacity")


class PagePool(_IdPool):
    kind = "page pool"

    def __init__(self, name: str, num_pages: int):
        super().__init__(name, num_pages)
        self._refs = [0] * num_pages

    @property
    def num_pages(self) -> int:
        return self.size

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
        if self._refs[SINK] != 0:
            raise PoolError(f"page pool {self.name!r}: the sink has references")
        self._check_free_list({i for i in range(1, self.size) if self._refs[i] > 0})


class SlotPool(_IdPool):
    """Recurrent state slots: one slot id indexes every recurrent layer; each slot has at most one owner."""

    kind = "state pool"

    def __init__(self, num_slots: int):
        super().__init__("state", num_slots)
        self._owner: dict[int, object] = {}

    @property
    def num_slots(self) -> int:
        return self.size

    def acquire(self, owner: object) -> int:
        if not self._free:
            raise PoolError("state pool: no free slot")
        slot = self._free.pop()
        self._owner[slot] = owner
        return slot

    def release(self, slot: int, owner: object) -> None:
        if slot not in self._owner or self._owner[slot] != owner:
            raise PoolError(f"state pool: release of slot {slot} by a request that does not own it")
        del self._owner[slot]
        self._free.append(slot)

    def owner(self, slot: int) -> object | None:
        return self._owner.get(slot)

    def check(self) -> None:
        self._check_free_list(set(self._owner))
