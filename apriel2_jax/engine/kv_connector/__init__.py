"""External KV connector: prefix entries (attention pages of every family, recurrent-state snapshots) kept
outside the device caches, keyed by the prefix cache's hash chain, in a bounded host-memory tier or on local
disk. ``base`` is the store interface, ``connector`` what the engine calls (claims, asynchronous loads and saves),
``transfer`` the device copies; ``host`` and ``disk`` are the stores."""

from .base import ConnectorError, Entry, EntryStore
from .connector import ConnectorStats, KVConnector, LoadResult
from .disk import DiskStore
from .host import HostMemoryStore

__all__ = ["ConnectorError", "ConnectorStats", "Entry", "EntryStore", "KVConnector", "LoadResult", "DiskStore", "HostMemoryStore"]
