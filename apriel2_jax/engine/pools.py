"""Host-side id pools: attention pages (one pool per family), recurrent state slots, and state snapshots for
prefix caching. Plain Python.

Id 0 of every pool is the sink: it absorbs the writes of padded rows and tokens, and is never allocated,
referenced, or freed.
"""

from __future__ import annotations

import collections

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
    """Attention pages with reference counts. With prefix caching, a full page can be *cached* under the hash
    of the tokens it holds (:mod:`.prefix_cache`): when its last reference goes it stays readable, on a
    least-recently-used list, until an allocation finds no never-cached page free and evicts it."""

    kind = "page pool"

    def __init__(self, name: str, num_pages: int):
        super().__init__(name, num_pages)
        self._refs = [0] * num_pages
        self._hash: dict[int, bytes] = {}  # cached page -> its hash
        self._by_hash: dict[bytes, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self.evictions = 0

    @property
    def num_pages(self) -> int:
        return self.size

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._hash)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise PoolError(f"page pool {self.name!r}: {count} pages asked, {self.num_free} free")
        ids = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:  # evict the least recently used cached page
                page, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash.pop(page)]
                self.evictions += 1
            self._refs[page] = 1
            ids.append(page)
        return ids

    def retain(self, ids) -> None:
        """One more reference to each page: in use (a shared prefix) or cached and unreferenced (a hit)."""
        for i in ids:
            if i == SINK or (self._refs[i] == 0 and i not in self._evictable):
                raise PoolError(f"page pool {self.name!r}: retain of page {i}, which is neither in use nor cached")
            if self._refs[i] == 0:
                del self._evictable[i]
            self._refs[i] += 1

    def release(self, ids) -> None:
        """Drop one reference to each page; a page left unreferenced is free, or evictable if it is cached.
        Pass a request's pages last-first, so its tail is evicted before the prefix it shares."""
        for i in ids:
            if i == SINK or self._refs[i] == 0:
                raise PoolError(f"page pool {self.name!r}: release of page {i}, which is not in use")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                if i in self._hash:
                    self._evictable[i] = None
                else:
                    self._free.append(i)

    def cache(self, page: int, key: bytes) -> None:
        """Publish a full, computed page under ``key``. A page already cached, or a key already held by another
        page (two requests computed the same prefix at once), is left as it is."""
        if page == SINK or self._refs[page] == 0:
            raise PoolError(f"page pool {self.name!r}: caching page {page}, which is not in use")
        if page not in self._hash and key not in self._by_hash:
            self._hash[page] = key
            self._by_hash[key] = page

    def lookup(self, key: bytes) -> int | None:
        return self._by_hash.get(key)

    def hash_of(self, page: int) -> bytes | None:
        return self._hash.get(page)

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def check(self) -> None:
        if self._refs[SINK] != 0 or SINK in self._hash:
            raise PoolError(f"page pool {self.name!r}: the sink has references or a hash")
        in_use = {i for i in range(1, self.size) if self._refs[i] > 0}
        evictable = set(self._evictable)
        if evictable & in_use or evictable & set(self._free):
            raise PoolError(f"page pool {self.name!r}: an evictable page is also in use or free")
        if any(i not in self._hash for i in evictable) or any(self._hash[p] not in self._by_hash for p in self._hash):
            raise PoolError(f"page pool {self.name!r}: an evictable page has no hash, or the hash maps disagree")
        if any(self._hash.get(p) != k for k, p in self._by_hash.items()) or set(self._free) & set(self._hash):
            raise PoolError(f"page pool {self.name!r}: the hash maps disagree, or a free page is cached")
        self._check_free_list(in_use | evictable)


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


class SnapshotPool:
    """Copies of a sequence's recurrent state (every recurrent layer's conv and SSM rows) at a page boundary,
    keyed by the hash of the prefix before it. They live in the same device arrays as the state slots, in rows
    ``first .. first + count - 1`` after them, so saving and restoring are row copies within one array.

    Least recently used snapshots are overwritten first; one whose save is still queued (``pinned``) is not."""

    def __init__(self, first: int, count: int):
        self.first = first
        self.count = count
        self._free = list(range(first + count - 1, first - 1, -1))
        self._by_hash: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # oldest first
        self._pinned: set[int] = set()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, key: bytes) -> int | None:
        return self._by_hash.get(key)

    def touch(self, key: bytes) -> None:
        self._by_hash.move_to_end(key)

    def store(self, key: bytes) -> int | None:
        """A row for a new snapshot under ``key``, pinned until :meth:`unpin`; None if ``key`` is stored already
        or every row is pinned."""
        if key in self._by_hash:
            self._by_hash.move_to_end(key)
            return None
        if self._free:
            row = self._free.pop()
        else:
            victim = next((k for k, r in self._by_hash.items() if r not in self._pinned), None)
            if victim is None:
                return None
            row = self._by_hash.pop(victim)
            self.evictions += 1
        self._by_hash[key] = row
        self._pinned.add(row)
        return row

    def unpin(self) -> None:
        self._pinned.clear()

    def check(self) -> None:
        rows = list(self._by_hash.values())
        if len(set(rows)) != len(rows) or set(rows) & set(self._free):
            raise PoolError("snapshot pool: a row is stored twice or stored and free")
        if len(rows) + len(self._free) != self.count or any(not self.first <= r < self.first + self.count for r in rows):
            raise PoolError("snapshot pool: stored + free != capacity, or a row outside the pool")
