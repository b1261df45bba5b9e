"""What a connector stores and the interface of a store. Plain Python + numpy.

An *entry* is one unit a prefix is made of, named by the prefix cache's chain hash (``prefix_cache.py``):

- a **page** entry, ``("page", chain[j])``: page ``j`` of the sequence for every attention family, each family's
  K and V over its layers, as numpy arrays;
- a **state** entry, ``("state", chain[k - 1])``: the recurrent state after ``k`` pages, every recurrent
  layer's conv and SSM rows.

A claim of ``L = k * page_size`` tokens needs the page entries ``0 .. k - 1`` and, with recurrent layers, the
state entry at ``k``. Stores hold entries as opaque named arrays, so one store serves any placement: the chain
hash already covers the placement and page size.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Iterable

import numpy as np


class ConnectorError(RuntimeError):
    """A store could not return an entry it claimed (missing, corrupt, truncated, timed out)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    kind: str  # "page" or "state"
    key: bytes  # the chain hash naming the prefix up to and including this page / up to this boundary
    arrays: dict[str, np.ndarray]  # name -> array ("full/3/k": family, layer, tensor)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    @property
    def id(self) -> tuple[str, bytes]:
        return self.kind, self.key


class EntryStore(abc.ABC):
    """A bounded key-value store of entries. ``contains`` may be optimistic (a later ``get`` can still fail);
    ``get`` raises :class:`ConnectorError` for anything it cannot return intact."""

    name = "store"
    # Whether a load reads entries on several threads: worth it when ``get`` releases the GIL for long (file
    # reads, checksums); a store whose ``get`` is Python bookkeeping and small copies only contends.
    parallel_reads = True

    @abc.abstractmethod
    def put(self, entry: Entry) -> None: ...

    @abc.abstractmethod
    def get(self, kind: str, key: bytes) -> Entry: ...

    @abc.abstractmethod
    def contains(self, kind: str, key: bytes) -> bool: ...

    def longest_prefix(self, chain: Iterable[bytes], need_state: bool, limit: int) -> int:
        """The largest ``k <= limit`` such that page entries ``0 .. k - 1`` are held and, if ``need_state``, a
        state entry at ``k`` (0 when none)."""
        best = 0
        for j, key in enumerate(list(chain)[:limit]):
            if not self.contains("page", key):
                break
            if not need_state or self.contains("state", key):
                best = j + 1
        return best
