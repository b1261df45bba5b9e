"""Prefix caching: identical outputs with and without it on every golden case and placement (hybrid ones
included), and the host-side pieces (hash chains, cached pages, snapshots, matching) on their own."""

import pytest

from apriel2_jax.engine.cache_layout import AttentionFamily, CacheLayout, CachePlan, StateFamily
from apriel2_jax.engine.cache_manager import CacheManager
from apriel2_jax.engine.llm import LLM
from apriel2_jax.engine.pools import PagePool, PoolError, SnapshotPool
from apriel2_jax.engine.prefix_cache import PrefixCache, extend_chain, prefix_root
from apriel2_jax.engine.sampling import SamplingParams
from apriel2_jax.engine.scheduler import Request
from apriel2_jax.engine.step import Buckets
from tests.conftest import golden_cases
from tests.helpers import golden_model

GREEDY = SamplingParams.greedy(max_new_tokens=4, ignore_eos=True)
# Pages of 4 tokens, chunks of 8 (the golden windows are 8 wide): prefixes below cross pages, chunks and windows.
ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=40, max_num_batched_tokens=16, max_chunk=8,
              max_prefill_rows=4, page_size=4, cache_bytes=4 * 2**20, warm_up=False, debug_checks=True,
              buckets=Buckets((4,), (4,), (1, 4, 8)), log=lambda msg: None)


def _shared_prefix_prompts(case):
    """Prompts sharing prefixes of 3 (under a page), 9 (past a window of 8), 16 (two chunks) and all tokens."""
    a = [int(t) for t in case.input_ids[0, : case.prompt_len]]
    b = [int(t) for t in case.input_ids[1, : case.prompt_len]]
    return [a, a[:3] + b[:10], a[:9] + b[:7], a[:16] + [5, 6, 7], a + b[:5], a[:16] + b[:2], a]


def _run(llm, prompts):
    """Each prompt alone (later ones hit earlier ones' pages), then all of them in one batch."""
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    return alone, [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("case_name", golden_cases())
def test_outputs_identical_with_and_without_prefix_caching(case_name):
    case, model, runner = golden_model(case_name)
    prompts = _shared_prefix_prompts(case)
    plain = LLM(model=model, placements=case.placements, step_runner=runner, enable_prefix_caching=False, **ENGINE)
    cached = LLM(model=model, placements=case.placements, step_runner=runner, **ENGINE)
    for name in case.placements:
        plain.set_placement(name)
        cached.set_placement(name)
        assert _run(cached, prompts) == _run(plain, prompts), f"{case_name}/{name}"
        stats = cached.stats.prefix
        assert stats.hit_tokens > 0, f"{case_name}/{name}: no prefix was reused"
        if cached.layout.state is not None:  # hybrid: resumed from state snapshots
            assert stats.snapshots_restored > 0 and stats.family_hit_tokens["state"] > 0
        for used, _ in cached.cache_manager.usage().values():
            assert used == 0  # cached pages are kept, but nothing is referenced after draining
        assert plain.stats.prefix.hit_tokens == 0


@pytest.fixture(scope="module")
def hybrid():
    """hybrid_all_mixers under 'mamba': full attention, a window of 8, GDN, KDA and Mamba layers."""
    return golden_model("hybrid_all_mixers")


def _hybrid_engine(hybrid, **overrides):
    case, model, runner = hybrid
    args = dict(ENGINE, model=model, placements=case.placements, placement="mamba", step_runner=runner)
    args.update(overrides)
    return LLM(**args)


def test_resent_prompt_prefills_only_its_suffix(hybrid):
    case = hybrid[0]
    llm = _hybrid_engine(hybrid)
    prompt = [int(t) for t in case.input_ids[0, : case.prompt_len]] + [7] * 10  # 31 tokens
    first = llm.generate([prompt], GREEDY)[0]
    # Chunks of 8 ended at 8, 16 and 24: snapshots there; pages 0..6 are full. The resend resumes at 24, and
    # ends a chunk at 28, where its known prefix (pages 0..6) stops, leaving a snapshot for the next resend.
    for hit, recomputed in ((24, 7), (28, 3)):
        before, hits = llm.stats.prefill_tokens, llm.stats.prefix.hit_tokens
        assert llm.generate([prompt], GREEDY)[0].token_ids == first.token_ids
        assert llm.stats.prefix.hit_tokens - hits == hit
        assert llm.stats.prefill_tokens - before == recomputed


def test_branch_point_gets_a_snapshot_so_the_third_request_hits(hybrid):
    """Two prompts share 12 tokens, then differ. The second computes from scratch but ends a chunk at the
    branch point (12), which no chunk of the first reached; the third resumes there."""
    llm = _hybrid_engine(hybrid, max_chunk=16, max_num_batched_tokens=16, buckets=Buckets((4,), (4,), (1, 4, 8, 16)))
    shared = list(range(3, 15))
    for suffix in ([40, 41, 42, 43, 44, 45, 46], [50, 51, 52, 53, 54], [60, 61, 62, 63, 64, 65]):
        llm.generate([shared + suffix], GREEDY)
    stats = llm.stats.prefix
    assert stats.queries == 3
    assert stats.hit_tokens == 12  # only the third request: the snapshot at 12 exists only after the second
    assert stats.family_hit_tokens["full"] == 12 + 12  # pages alone would have served the second as well


def test_requests_waiting_on_a_branch_point_another_request_is_about_to_snapshot(hybrid):
    """An earlier request computed a 20-token prefix but left snapshots only at its chunk ends (16). Four new
    requests share those 20 tokens: the first resumes at 16 and ends a chunk at 20 (the branch point); the
    other three wait one step for that snapshot instead of recomputing 16..20 each."""
    llm = _hybrid_engine(hybrid, max_num_batched_tokens=32, max_chunk=16, buckets=Buckets((4,), (4,), (1, 4, 8, 16)))
    plain = _hybrid_engine(hybrid, enable_prefix_caching=False, max_num_batched_tokens=32, max_chunk=16,
                           buckets=Buckets((4,), (4,), (1, 4, 8, 16)))
    shared = list(range(3, 23))
    earlier = shared + [99, 98, 97]
    prompts = [shared + [30 + i, 31 + i] for i in range(4)]
    got = [o.token_ids for o in llm.generate([earlier], GREEDY) + llm.generate(prompts, GREEDY)]
    assert got == [o.token_ids for o in plain.generate([earlier], GREEDY) + plain.generate(prompts, GREEDY)]
    assert llm.stats.prefill_tokens == 23 + (4 + 2) + 3 * 2
    assert llm.stats.prefix.hit_tokens == 16 + 3 * 20


def test_requests_submitted_together_compute_their_shared_prefix_once(hybrid):
    """Four new prompts share 20 tokens (nothing computed before). The first ends a chunk where its prefix stops
    being shared with the queued ones (20, inside its second chunk); the others wait for that snapshot and
    compute only their own 2 tokens: the hit rate attention pages alone would give."""
    kw = dict(max_num_batched_tokens=32, max_chunk=16, buckets=Buckets((4,), (4,), (1, 4, 8, 16)))
    llm = _hybrid_engine(hybrid, **kw)
    plain = _hybrid_engine(hybrid, enable_prefix_caching=False, **kw)
    shared = list(range(3, 23))
    prompts = [shared + [30 + i, 31 + i] for i in range(4)]
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert llm.stats.prefill_tokens == 22 + 3 * 2
    assert llm.stats.prefix.hit_tokens == 3 * 20
    assert llm.stats.prefix.family_hit_tokens["state"] == llm.stats.prefix.family_hit_tokens["full"] == 3 * 20


def test_snapshot_interval_ends_chunks_at_its_multiples(hybrid):
    """Chunks of 16 with an interval of 8: the first prompt leaves snapshots at 8 and 16, so a prompt sharing
    its first 13 tokens resumes at 8 although it is the first to diverge there (a branch point at 12)."""
    llm = _hybrid_engine(hybrid, max_chunk=16, max_num_batched_tokens=16, snapshot_interval=8,
                         buckets=Buckets((4,), (4,), (1, 4, 8, 16)))
    first = list(range(3, 23))
    llm.generate([first], GREEDY)
    assert llm.stats.prefix.snapshots_saved == 3  # at 8, 16 and 20 (the last chunk's end is a page boundary)
    llm.generate([first[:13] + [60, 61, 62]], GREEDY)
    assert llm.stats.prefix.hit_tokens == 8
    with pytest.raises(Exception, match="snapshot_interval must be 0 or a multiple of page_size=4"):
        _hybrid_engine(hybrid, snapshot_interval=6)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_preemption_and_abort_with_prefix_caching(hybrid, decode_steps):
    """A pool too small for four requests at once: preempted requests come back through the prefix cache (their
    own pages and snapshots) and produce the same tokens; an abort mid-prefill leaks nothing."""
    case = hybrid[0]
    prompts = _shared_prefix_prompts(case)[:4]
    params = SamplingParams.greedy(max_new_tokens=10, ignore_eos=True)
    # Same decode steps as the tight engine: the sliding-window pool is sized for a dispatch's tokens.
    roomy = _hybrid_engine(hybrid, enable_prefix_caching=False, decode_steps=decode_steps)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    full = next(f for f in roomy.layout.attention if f.window is None)
    page_bytes, slot_bytes = 4 * full.token_bytes, roomy.layout.state.slot_bytes
    # 12 usable pages of full attention (the four need 29 without sharing), 8 snapshots.
    budget = sum(v for k, v in roomy.plan.bytes.items() if k != "full") + 13 * page_bytes + 8 * slot_bytes
    tight = _hybrid_engine(hybrid, cache_bytes=budget, snapshot_memory_fraction=(8.5 * slot_bytes) / budget,
                           decode_steps=decode_steps)
    assert (tight.plan.pages["full"], tight.plan.snapshots) == (13, 8)
    assert [o.token_ids for o in tight.generate(prompts, params)] == expected
    assert tight.stats.preemptions > 0
    # Abort one request after its first chunk: its pages are released (kept cached), nothing stays referenced.
    ids = [tight.add_request(p, params) for p in prompts]
    tight.step()
    assert tight.abort(ids[1])
    while tight.has_unfinished_requests:
        tight.step()
    assert all(used == 0 for used, _ in tight.cache_manager.usage().values())
    tight.scheduler.check_invariants()


def test_switching_placement_drops_the_cache(hybrid):
    case = hybrid[0]
    llm = _hybrid_engine(hybrid)
    prompt = [int(t) for t in case.input_ids[0, : case.prompt_len]]
    llm.generate([prompt], GREEDY)
    llm.set_placement("gdn")
    llm.generate([prompt], GREEDY)
    assert llm.stats.prefix.hit_tokens == 0  # a new placement starts empty
    llm.generate([prompt], GREEDY)
    assert llm.stats.prefix.hit_tokens > 0
    assert prefix_root(llm.placement, 4) != prefix_root(("attention",) * len(llm.placement), 4)


# ----------------------------------------------------------------------------------------------------------------
# Host-side pieces


def test_hash_chain_names_whole_prefixes():
    root = prefix_root(("attention",), 4)
    a, b = [], []
    extend_chain(a, list(range(12)), 4, 3, root)
    extend_chain(b, [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11], 4, 3, root)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # page 2 holds the same tokens, after another page 1
    c = a[:1]
    extend_chain(c, list(range(12)), 4, 3, root)  # incremental extension gives the same chain
    assert c == a
    other = []
    extend_chain(other, list(range(12)), 4, 3, prefix_root(("gdn",), 4))
    assert not set(other) & set(a)


def test_cached_pages_are_evicted_least_recently_used_and_only_when_unreferenced():
    pool = PagePool("full", 5)  # pages 1..4
    pages = pool.allocate(3)
    for page, key in zip(pages, (b"a", b"b", b"c")):
        pool.cache(page, key)
    pool.release(reversed(pages))  # tail first: c, b, a on the LRU list
    assert pool.num_free == 4 and pool.num_cached == 3
    fresh = pool.allocate(1)  # the never-cached page goes first
    assert fresh[0] not in pages and pool.num_cached == 3
    pool.retain([pool.lookup(b"a")])  # a hit revives "a"
    assert pool.refcount(pool.lookup(b"a")) == 1
    pool.retain([pool.lookup(b"b")])  # b is hit (and released) more recently than c
    pool.release([pool.lookup(b"b")])
    evicted = pool.allocate(1)
    assert evicted == [pages[2]] and pool.lookup(b"c") is None and pool.evictions == 1
    with pytest.raises(PoolError, match="page pool"):
        pool.allocate(2)  # only "b" is left to evict
    pool.check()


def test_snapshot_pool_overwrites_oldest_but_never_a_pending_save():
    pool = SnapshotPool(first=5, count=2)
    assert pool.store(b"x") in (5, 6) and pool.store(b"y") in (5, 6)
    assert pool.store(b"z") is None  # both pinned until their saves run
    pool.unpin()
    assert pool.store(b"x") is None  # already stored: nothing to copy
    row = pool.store(b"z")  # y is now the oldest
    assert row is not None and pool.lookup(b"y") is None and pool.lookup(b"z") == row
    pool.check()


def _host_cache(window=8, page_size=4, snapshots=4):
    layout = CacheLayout(
        (AttentionFamily(f"window_{window}", window, (1,), 4), AttentionFamily("full", None, (0,), 4)),
        StateFamily((2,), 64),
    )
    plan = CachePlan(page_size, {f"window_{window}": 20, "full": 30}, {f"window_{window}": 5, "full": 10}, 3,
                     {}, snapshots)
    manager = CacheManager(layout, plan)
    return manager, PrefixCache(manager, prefix_root(("x",), page_size), (plan.slots, plan.snapshots))


def _prefill(manager, prefix, request, tokens, chunk):
    """Pretend ``request`` prefilled its first ``tokens`` tokens in chunks of ``chunk``."""
    while request.num_computed < tokens:
        length = min(chunk, tokens - request.num_computed)
        assert manager.try_allocate(request.request_id, request.num_computed, length)
        request.num_computed += length
        prefix.chunk_done(request, request.num_computed)


def test_match_needs_every_family_and_only_the_window_pages_in_view():
    manager, prefix = _host_cache()
    first = Request("a", list(range(30)), GREEDY)
    _prefill(manager, prefix, first, 24, chunk=8)  # pages 0..5 published; snapshots at 8, 16, 24
    saves, _ = prefix.take_copies()
    assert len(saves) == 3
    # Before its last chunk (from 16) the request released window pages 0..1: queries at 16.. see 9.. only.
    assert manager.blocks("a").first_page["window_8"] == 2
    second = Request("b", list(range(30)) + [1], GREEDY)
    hit = prefix.match(second)
    assert hit.tokens == 24 and hit.snapshot == saves[-1][1]
    # A query at 24 sees 17..24 through a window of 8: pages 4 and 5 only.
    assert hit.first_page == {"window_8": 4, "full": 0} and len(hit.pages["full"]) == 6
    assert hit.pages["window_8"] == manager.blocks("a").tables["window_8"][-2:]
    # The window pages that slid out were released first, so they are evicted first; the hit at 24 survives.
    manager.free("a")
    window = manager.pools["window_8"]
    never_cached = window.num_free - window.num_cached
    taken = window.allocate(never_cached + 2)
    assert window.evictions == 2 and prefix.match(second).tokens == 24
    # The request's tail goes next (released last-first): page 5, in view at 24. The hit falls back to 16
    # (snapshot there, window pages 2..3 still cached).
    taken += window.allocate(1)
    assert prefix.match(second).tokens == 16
    window.release(taken)
    hit = prefix.match(second)
    assert prefix.admit(second, hit, 7)
    assert prefix.take_copies() == ([], [(hit.snapshot, manager.blocks("b").slot)])
    prefix.check([second])
    manager.check_invariants()


def test_match_without_a_snapshot_resumes_only_at_zero():
    manager, prefix = _host_cache(snapshots=0)
    _prefill(manager, prefix, Request("a", list(range(30)), GREEDY), 24, chunk=8)
    hit = prefix.match(Request("b", list(range(30)), GREEDY))
    assert hit.tokens == 0 and hit.family_tokens["full"] == 24 and hit.family_tokens["state"] == 0


def test_hash_ahead_leaves_match_nothing_to_hash():
    """Chains hashed ahead (while a step runs) are the ones the admission lookup reads: match then extends no
    chain, and finds the same hit as without hashing ahead. A request the cache must not index is skipped."""
    manager, prefix = _host_cache()
    _prefill(manager, prefix, Request("a", list(range(30)), GREEDY), 24, chunk=8)
    ahead, cold = Request("b", list(range(30)) + [1], GREEDY), Request("c", list(range(30)) + [1], GREEDY)
    skipped = Request("d", list(range(30)), GREEDY)
    skipped.prefix_cacheable = False
    prefix.hash_ahead([ahead, skipped])
    assert len(ahead.page_hashes) == (ahead.num_tokens - 1) // 4 and skipped.page_hashes == []
    hashed = list(ahead.page_hashes)
    assert prefix.match(ahead) == prefix.match(cold)
    assert ahead.page_hashes == hashed == cold.page_hashes
