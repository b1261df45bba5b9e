"""The connector's stores on their own: round trips, bounds, corruption detection, atomic files, and a disk
store reused by another process."""

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from apriel2_jax.engine.kv_connector import ConnectorError, DiskStore, Entry, HostMemoryStore

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _entry(kind, key, seed=0, size=16):
    rng = np.random.default_rng(seed)
    return Entry(kind, key, {
        "full/0/k": rng.standard_normal((4, 2, size)).astype(ml_dtypes.bfloat16),
        "full/0/v": rng.standard_normal((4, 2, size)).astype(np.float32),
    })


def _equal(a, b):
    assert a.id == b.id and a.arrays.keys() == b.arrays.keys()
    for name in a.arrays:
        assert a.arrays[name].dtype == b.arrays[name].dtype
        np.testing.assert_array_equal(a.arrays[name].astype(np.float32), b.arrays[name].astype(np.float32))


def test_host_store_round_trip_copies_and_evicts_least_recently_used():
    entry = _entry("page", b"a")
    store = HostMemoryStore(capacity_bytes=3 * entry.nbytes)
    store.put(entry)
    entry.arrays["full/0/v"][:] = 0  # the store kept its own copy
    assert np.abs(store.get("page", b"a").arrays["full/0/v"]).sum() > 0
    store.put(_entry("page", b"b"))
    store.put(_entry("state", b"a"))
    store.get("page", b"a")  # a is now the most recently used
    store.put(_entry("page", b"c"))
    assert not store.contains("page", b"b") and store.contains("page", b"a") and store.evictions == 1
    with pytest.raises(ConnectorError, match="no page entry"):
        store.get("page", b"b")
    store.put(_entry("page", b"huge", size=4096))  # larger than the tier: not kept, nothing evicted
    assert not store.contains("page", b"huge") and len(store) == 3


def test_longest_prefix_needs_every_page_and_a_state_at_the_end():
    store = HostMemoryStore(1 << 20)
    chain = [b"0", b"1", b"2", b"3"]
    for key in chain[:3]:
        store.put(_entry("page", key))
    store.put(_entry("state", b"1"))
    assert store.longest_prefix(chain, need_state=False, limit=4) == 3
    assert store.longest_prefix(chain, need_state=True, limit=4) == 2
    assert store.longest_prefix(chain, need_state=False, limit=2) == 2


def test_disk_store_round_trip_atomic_files_and_corruption(tmp_path):
    store = DiskStore(tmp_path / "kv")
    entry = _entry("page", bytes(range(16)))
    store.put(entry)
    _equal(store.get("page", entry.key), entry)
    files = [f for _, _, names in os.walk(tmp_path) for f in names]
    assert len(files) == 1 and not any(".part" in f or f.startswith(".tmp") for f in files)
    path = store._path("page", entry.key)
    raw = bytearray(open(path, "rb").read())
    raw[-3] ^= 0xFF  # one flipped byte of the payload
    open(path, "wb").write(bytes(raw))
    with pytest.raises(ConnectorError, match="corrupt.*checksum"):
        store.get("page", entry.key)
    open(path, "wb").write(bytes(raw[:20]))  # truncated mid-header
    with pytest.raises(ConnectorError, match="corrupt"):
        store.get("page", entry.key)
    os.unlink(path)
    with pytest.raises(ConnectorError, match="no page entry"):
        store.get("page", entry.key)


def test_disk_store_evicts_beyond_its_capacity(tmp_path):
    first = _entry("page", b"\x01")
    store = DiskStore(tmp_path, capacity_bytes=int(2.5 * (first.nbytes + 400)))
    for i in range(4):
        store.put(_entry("page", bytes([i + 1]), seed=i))
    assert store.evictions >= 1 and not store.contains("page", b"\x01") and store.contains("page", b"\x04")
    assert store.nbytes <= store.capacity_bytes


def test_disk_store_is_reused_by_another_process(tmp_path):
    store = DiskStore(tmp_path)
    for i in range(3):
        store.put(_entry("page", bytes([i]), seed=i))
    store.put(_entry("state", bytes([1]), seed=9))
    script = (
        "import sys, numpy as np\n"
        "from apriel2_jax.engine.kv_connector import DiskStore\n"
        "s = DiskStore(sys.argv[1])\n"
        "print(len(s), s.longest_prefix([bytes([0]), bytes([1]), bytes([2])], True, 3),"
        " float(s.get('state', bytes([1])).arrays['full/0/v'].sum()))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    count, longest, total = out.stdout.split()
    assert (int(count), int(longest)) == (4, 2)
    assert float(total) == pytest.approx(float(_entry("state", bytes([1]), seed=9).arrays["full/0/v"].sum()), rel=1e-6)
