"""The local-disk tier: one file per entry, written atomically, verified by a content checksum on every read,
and reusable by a later engine process (the directory is the index).

File format: 8-byte little-endian header length, a JSON header (format version, kind, key, then per array its
name, dtype, shape, byte offset and length, and the SHA-256 of the payload), then the arrays' bytes. A file is
written to a temporary name in its own directory, flushed to disk and renamed over the final name, so readers
see the old file, the new one, or none, never half of one.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import struct
import tempfile
import threading

import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy)
import numpy as np

from .base import ConnectorError, Entry, EntryStore

FORMAT = 1
SUFFIX = ".entry"


class DiskStore(EntryStore):
    name = "disk"

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int | None = None):
        """``capacity_bytes``: evict the least recently used files beyond it (None: unbounded)."""
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.evictions = 0
        self._lock = threading.Lock()
        # Existing entries (a store written by an earlier process), least recently used first.
        found = []
        for root, _, files in os.walk(self.directory):
            for name in files:
                if name.endswith(SUFFIX):
                    path = os.path.join(root, name)
                    stat = os.stat(path)
                    found.append((stat.st_mtime, path, stat.st_size))
        self._files: collections.OrderedDict[str, int] = collections.OrderedDict(
            (path, size) for _, path, size in sorted(found)
        )
        self.nbytes = sum(self._files.values())

    def _path(self, kind: str, key: bytes) -> str:
        if kind not in ("page", "state"):
            raise ValueError(f"entry kind must be 'page' or 'state', got {kind!r}")
        name = key.hex()
        return os.path.join(self.directory, kind, name[:2], name + SUFFIX)

    def put(self, entry: Entry) -> None:
        path = self._path(entry.kind, entry.key)
        arrays, offset, specs = [], 0, []
        for name, array in entry.arrays.items():
            data = np.ascontiguousarray(array)
            specs.append({"name": name, "dtype": data.dtype.name, "shape": list(data.shape), "offset": offset,
                          "length": data.nbytes})
            arrays.append(data)
            offset += data.nbytes
        digest = hashlib.sha256()
        for data in arrays:
            digest.update(data.reshape(-1).view(np.uint8))
        header = json.dumps({"format": FORMAT, "kind": entry.kind, "key": entry.key.hex(), "arrays": specs,
                             "sha256": digest.hexdigest()}).encode()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=SUFFIX + ".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(struct.pack("<Q", len(header)))
                f.write(header)
                for data in arrays:
                    f.write(data.reshape(-1).view(np.uint8).tobytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        size = 8 + len(header) + offset
        with self._lock:
            self.nbytes += size - self._files.pop(path, 0)
            self._files[path] = size
            self._evict()

    def _evict(self) -> None:
        while self.capacity_bytes is not None and self.nbytes > self.capacity_bytes and len(self._files) > 1:
            path, size = self._files.popitem(last=False)
            self.nbytes -= size
            self.evictions += 1
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def get(self, kind: str, key: bytes) -> Entry:
        path = self._path(kind, key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            with self._lock:
                self._files.pop(path, None)
            raise ConnectorError(f"disk store: no {kind} entry {key.hex()} ({path})") from None
        except OSError as e:
            raise ConnectorError(f"disk store: cannot read {path}: {e}") from e
        try:
            (length,) = struct.unpack_from("<Q", raw)
            header = json.loads(raw[8 : 8 + length])
            payload = memoryview(raw)[8 + length :]
            if header.get("format") != FORMAT or header.get("kind") != kind or header.get("key") != key.hex():
                raise ValueError("header names another entry or format")
            if hashlib.sha256(payload).hexdigest() != header["sha256"]:
                raise ValueError("content checksum mismatch")
            arrays = {}
            for spec in header["arrays"]:
                start, length = spec["offset"], spec["length"]
                if start + length > len(payload):
                    raise ValueError("truncated")
                data = np.frombuffer(payload[start : start + length], dtype=np.dtype(spec["dtype"]))
                arrays[spec["name"]] = data.reshape(spec["shape"])
        except (ValueError, KeyError, TypeError, struct.error) as e:  # json errors are ValueErrors
            raise ConnectorError(f"disk store: {path} is corrupt ({e})") from e
        with self._lock:
            if path in self._files:
                self._files.move_to_end(path)
        return Entry(kind, key, arrays)

    def contains(self, kind: str, key: bytes) -> bool:
        path = self._path(kind, key)
        with self._lock:
            if path in self._files:
                return True
        if os.path.exists(path):  # written by another process since this one started
            with self._lock:
                self._files[path] = os.path.getsize(path)
            return True
        return False

    def __len__(self) -> int:
        return len(self._files)
