"""The external KV connector in the engine: outputs identical whether a prefix was recomputed, hit in the local
prefix cache or loaded from host memory or disk; every failure mode of a store (missing, corrupt, slow, partial
entries) ends in a recompute from the last good boundary with consistent block tables; a second process reuses
a disk store."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from apriel2_jax.engine.kv_connector import ConnectorError, DiskStore, Entry, EntryStore, HostMemoryStore
from apriel2_jax.engine.llm import LLM
from tests.conftest import GOLDENS, golden_cases
from tests.helpers import golden_model
from tests.engine.test_prefix_cache import ENGINE, GREEDY, _shared_prefix_prompts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class FaultyStore(EntryStore):
    """A store that claims to hold what ``inner`` holds but fails reads on demand: ``missing`` keys raise,
    ``corrupt`` keys come back with a truncated array, ``delay`` seconds pass before every read, and after
    ``fail_after`` good reads every read fails (a partial load)."""

    name = "faulty"

    def __init__(self, inner: EntryStore):
        self.inner = inner
        self.missing: set = set()
        self.corrupt: set = set()
        self.delay = 0.0
        self.fail_after: int | None = None
        self.reads = 0
        self.read_keys: list = []  # in the order the reads were counted
        self._lock = threading.Lock()  # a load reads its pages on several threads
        self.release = threading.Event()  # set: a delayed read returns at once (tests end without waiting)

    def put(self, entry):
        self.inner.put(entry)

    def contains(self, kind, key):
        return self.inner.contains(kind, key)

    def get(self, kind, key):
        if self.delay:
            self.release.wait(self.delay)
        with self._lock:
            self.reads += 1
            self.read_keys.append((kind, key))
            over = self.fail_after is not None and self.reads > self.fail_after
        if (kind, key) in self.missing or over:
            raise ConnectorError(f"injected: {kind} entry unavailable")
        entry = self.inner.get(kind, key)
        if (kind, key) in self.corrupt:
            name = sorted(entry.arrays)[0]
            arrays = dict(entry.arrays, **{name: entry.arrays[name].reshape(-1)[:-1]})
            return Entry(kind, key, arrays)
        return entry


def _engine(model, runner, case, store, placement, **overrides):
    args = dict(ENGINE, model=model, placements=case.placements, placement=placement, step_runner=runner,
                kv_connector=store)
    args.update(overrides)
    return LLM(**args)


def _alone(llm, prompts):
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def _drained(llm):
    llm.kv_connector.flush()
    llm.scheduler.check_invariants()
    assert all(used == 0 for used, _ in llm.cache_manager.usage().values())
    assert not llm.scheduler.loading and llm.kv_connector.in_flight == 0


@pytest.mark.parametrize("case_name", golden_cases())
def test_outputs_identical_recomputed_local_host_and_disk(case_name, tmp_path):
    """Per placement: a writer engine computes the prompts and saves them; fresh engines (empty device caches)
    reading the same host store load the prefixes instead of computing them, then hit locally. The disk store
    runs the same engine path, so it is exercised on the first placement only (its own behaviour is tested
    below and in test_stores)."""
    case, model, runner = golden_model(case_name)
    prompts = _shared_prefix_prompts(case)
    plain = LLM(model=model, placements=case.placements, step_runner=runner, enable_prefix_caching=False, **ENGINE)
    for i, name in enumerate(case.placements):
        plain.set_placement(name)
        expected = _alone(plain, prompts)
        expected_batch = [o.token_ids for o in plain.generate(prompts, GREEDY)]
        stores = [HostMemoryStore(64 * 2**20)] + ([DiskStore(tmp_path / name)] if i == 0 else [])
        for store in stores:
            writer = _engine(model, runner, case, store, name)
            assert _alone(writer, prompts) == expected, f"{case_name}/{name}: writer"
            writer.kv_connector.flush()
            assert writer.stats.connector.tokens_saved > 0
            reader = _engine(model, runner, case, store, name)
            assert _alone(reader, prompts) == expected, f"{case_name}/{name}: {store.name} reader"
            stats = reader.stats.connector
            assert stats.tokens_loaded > 0 and stats.failed_loads == 0, f"{case_name}/{name}: {stats}"
            assert reader.stats.prefill_tokens < writer.stats.prefill_tokens
            _drained(reader)
            batch = _engine(model, runner, case, store, name, debug_checks=True)  # loads side by side, waits
            assert [o.token_ids for o in batch.generate(prompts, GREEDY)] == expected_batch, f"{case_name}/{name}"
            assert batch.stats.connector.tokens_loaded > 0
            _drained(batch)


@pytest.fixture(scope="module")
def hybrid():
    """hybrid_all_mixers under 'mamba': full attention, a window of 8, GDN, KDA and Mamba layers."""
    case, model, runner = golden_model("hybrid_all_mixers")
    prompt = [int(t) for t in case.input_ids[0, : case.prompt_len]] + [7] * 10  # 31 tokens: pages 0..6
    plain = _engine(model, runner, case, None, "mamba", enable_prefix_caching=False)
    expected = _alone(plain, [prompt])[0]
    store = HostMemoryStore(64 * 2**20)
    writer = _engine(model, runner, case, store, "mamba")
    assert _alone(writer, [prompt])[0] == expected
    writer.kv_connector.flush()  # chunks of 8: state entries at 8, 16 and 24; pages 0..6
    return case, model, runner, prompt, expected, store


def _faulty_reader(hybrid, **overrides):
    case, model, runner, prompt, expected, store = hybrid
    fresh = HostMemoryStore(store.capacity_bytes)  # what the writer saved; readers' own saves stay their own
    for entry in list(store._entries.values()):
        fresh.put(entry)
    faulty = FaultyStore(fresh)
    return _engine(model, runner, case, faulty, "mamba", **overrides), faulty


def _chain(llm, prompt):
    from apriel2_jax.engine.scheduler import Request

    return llm.prefix_cache.chain(Request("probe", prompt, None), len(prompt) // llm.page_size)


def test_a_full_load_skips_the_prefix(hybrid):
    prompt, expected = hybrid[3], hybrid[4]
    reader, _ = _faulty_reader(hybrid)
    assert _alone(reader, [prompt])[0] == expected
    assert reader.stats.connector.tokens_loaded == 24
    assert reader.stats.prefill_tokens == 31 - 24
    _drained(reader)


@pytest.mark.parametrize("fault", ["missing_page", "corrupt_page", "missing_state", "corrupt_state", "partial"])
def test_a_failed_load_recomputes_from_the_last_good_boundary(hybrid, fault):
    """The claim is 24 tokens (pages 0..5, the state at 24). A load that stops short resumes from the last
    boundary with every page before it and a state entry there, recomputes the rest, and gives the same tokens;
    the entries that failed are never claimed again."""
    prompt, expected = hybrid[3], hybrid[4]
    reader, faulty = _faulty_reader(hybrid, debug_checks=True)
    chain = _chain(reader, prompt)
    resume = {
        "missing_page": 16,  # page 4 missing: pages 0..3 and the state at 16
        "corrupt_page": 8,  # page 2 corrupt: pages 0..1 and the state at 8
        "missing_state": 16,  # the state at 24 missing: the one at 16
        "corrupt_state": 16,
        "partial": 0,  # three good page reads (parallel threads: any three), then every read, the state's too
    }[fault]
    if fault == "missing_page":
        faulty.missing.add(("page", chain[4]))
    elif fault == "corrupt_page":
        faulty.corrupt.add(("page", chain[2]))
    elif fault == "missing_state":
        faulty.missing.add(("state", chain[5]))
    elif fault == "corrupt_state":
        faulty.corrupt.add(("state", chain[5]))
    else:
        faulty.fail_after = 3
    assert _alone(reader, [prompt])[0] == expected
    stats = reader.stats.connector
    assert stats.failed_loads == 1 and stats.loads == 1
    assert stats.tokens_loaded == resume
    assert reader.stats.prefill_tokens == 31 - resume  # resumed from the loaded prefix, now cached locally
    _drained(reader)
    failed = {(kind, key) for kind, key in faulty.read_keys if (kind, key) in faulty.missing | faulty.corrupt}
    if fault == "partial":
        failed = set(faulty.read_keys[3:])
    reads_before = len(faulty.read_keys)
    # A second request for the same prompt: the failed entries are not claimed again.
    reader.reset_stats()
    assert _alone(reader, [prompt])[0] == expected
    assert reader.stats.connector.failed_loads == 0
    assert failed and not failed & set(faulty.read_keys[reads_before:])
    _drained(reader)


def test_a_slow_load_times_out_and_others_run_meanwhile(hybrid):
    """A load that never returns is abandoned at its deadline and the request recomputes; another request that
    needs no load runs to completion while the first one waits."""
    case, prompt, expected = hybrid[0], hybrid[3], hybrid[4]
    reader, faulty = _faulty_reader(hybrid, kv_load_timeout=1.5)
    faulty.delay = 60.0
    other = [int(t) for t in case.input_ids[1, : case.prompt_len]]
    other_expected = _alone(_engine(hybrid[1], hybrid[2], case, None, "mamba", enable_prefix_caching=False), [other])[0]
    try:
        first = reader.add_request(prompt, GREEDY)
        second = reader.add_request(other, GREEDY)
        outputs, order = {}, []
        start = time.monotonic()
        while reader.has_unfinished_requests:
            assert time.monotonic() - start < 30, "the engine hung on a slow load"
            for event in reader.step():
                if event.finished:
                    outputs[event.index] = event.output.token_ids
                    order.append(event.index)
        assert outputs == {first: expected, second: other_expected}
        assert order[0] == second  # it finished while the first was still loading
        stats = reader.stats.connector
        assert stats.timeouts == 1 and stats.failed_loads == 1 and stats.tokens_loaded == 0
        _drained(reader)
    finally:
        faulty.release.set()


def test_aborting_a_loading_request_frees_its_blocks(hybrid):
    prompt = hybrid[3]
    reader, faulty = _faulty_reader(hybrid)
    faulty.delay = 60.0
    try:
        request_id = reader.add_request(prompt, GREEDY)
        reader.step()
        assert request_id in reader.scheduler.loading
        reader.scheduler.check_invariants()
        assert reader.abort(request_id)
        assert not reader.has_unfinished_requests
        _drained(reader)
    finally:
        faulty.release.set()


def test_zero_token_steps_while_every_request_is_loading(hybrid):
    prompt, expected = hybrid[3], hybrid[4]
    reader, faulty = _faulty_reader(hybrid)
    faulty.delay = 0.05
    outputs = [e.output.token_ids for e in reader.stream([prompt, prompt], GREEDY) if e.finished]
    assert outputs == [expected, expected]
    assert reader.stats.connector.loads == 1  # the second request waited and hit locally after the first's load
    # The first computes from its loaded 24 tokens and ends a chunk at the last page boundary its queued copy
    # shares (pages of 4, one token left to compute), where the second resumes.
    assert reader.stats.prefix.hit_tokens == (len(prompt) - 1) // 4 * 4
    _drained(reader)


def test_connector_needs_prefix_caching(hybrid):
    with pytest.raises(Exception, match="kv_connector needs enable_prefix_caching"):
        _faulty_reader(hybrid, enable_prefix_caching=False)


SECOND_PROCESS = """
import json, os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, {repo!r})
from apriel2_jax.engine.kv_connector import DiskStore
from apriel2_jax.engine.llm import LLM
from apriel2_jax.engine.sampling import SamplingParams
from apriel2_jax.engine.step import Buckets
from apriel2_jax.parity import load_case
case = load_case({directory!r})
llm = LLM({directory!r}, placements=case.placements, placement="mamba", kv_connector=DiskStore({store!r}),
          dtype="float32", max_num_seqs=4, max_model_len=40, max_num_batched_tokens=16, max_chunk=8,
          max_prefill_rows=4, page_size=4, cache_bytes=4 * 2**20, warm_up=False, buckets=Buckets((4,), (4,), (1, 4, 8)),
          compilation_cache="off", log=lambda msg: None)
out = llm.generate([{prompt!r}], SamplingParams.greedy(max_new_tokens=4, ignore_eos=True))[0]
print(json.dumps({{"tokens": out.token_ids, "loaded": llm.stats.connector.tokens_loaded,
                   "prefill": llm.stats.prefill_tokens}}))
"""


def test_a_second_process_reuses_a_disk_store(hybrid, tmp_path):
    import json

    case, model, runner, prompt, expected, _ = hybrid
    writer = _engine(model, runner, case, DiskStore(tmp_path), "mamba")
    assert _alone(writer, [prompt])[0] == expected
    writer.kv_connector.flush()
    script = SECOND_PROCESS.format(repo=REPO, directory=os.path.join(GOLDENS, "hybrid_all_mixers"),
                                   store=str(tmp_path), prompt=prompt)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"tokens": expected, "loaded": 24, "prefill": 31 - 24}


def test_disk_corruption_is_detected_by_checksum_and_recomputed(hybrid, tmp_path):
    case, model, runner, prompt, expected, _ = hybrid
    store = DiskStore(tmp_path)
    writer = _engine(model, runner, case, store, "mamba")
    assert _alone(writer, [prompt])[0] == expected
    writer.kv_connector.flush()
    chain = _chain(writer, prompt)
    path = store._path("page", chain[3])
    raw = bytearray(open(path, "rb").read())
    raw[-5] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    reader = _engine(model, runner, case, DiskStore(tmp_path), "mamba")
    assert _alone(reader, [prompt])[0] == expected
    assert reader.stats.connector.failed_loads == 1
    assert reader.stats.connector.tokens_loaded == 8  # pages 0..2 good; the nearest state before page 3: 8
    _drained(reader)


def test_reused_load_buffers_hold_only_the_current_load():
    """Host buffers are reused from one load to the next (with a copying stage): rows of the current load only,
    the padding rows zero, and earlier results untouched."""
    from apriel2_jax.engine.kv_connector.connector import KVConnector, _Load

    specs = {"full/0/k": ((2, 3), np.dtype(np.float32)), "full/0/v": ((2, 3), np.dtype(np.float32))}
    chain = [bytes([i]) * 16 for i in range(8)]
    store = HostMemoryStore(2**20)
    for i, key in enumerate(chain):
        store.put(Entry("page", key, {n: np.full(s, i + 1, d) for n, (s, d) in specs.items()}))
    connector = KVConnector(store, stage=lambda tree: {k: np.array(v, copy=True) for k, v in tree.items()})
    connector.configure(4, specs, {})
    results = [connector._run_load(_Load("r", chain, first, 8, float("inf"))) for first in (0, 3, 5)]
    for result, first in zip(results, (0, 3, 5)):
        rows = result.pages["full/0/v"][:, 0, 0]
        assert result.good_pages == 8
        np.testing.assert_array_equal(rows[: 8 - first], np.arange(first, 8) + 1)
        assert not rows[8 - first :].any()  # padding to a power of two: zeros
    assert len(results[1].pages["full/0/k"]) == 8 and len(results[2].pages["full/0/k"]) == 4
