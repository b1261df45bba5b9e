"""Scheduler + cache manager on the host alone (no model): random traffic keeps every invariant."""

import dataclasses
import random

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from apriel2_jax.engine.cache_layout import AttentionFamily, CacheLayout, StateFamily, plan_cache
from apriel2_jax.engine.cache_manager import CacheManager
from apriel2_jax.engine.prefix_cache import PrefixCache, prefix_root
from apriel2_jax.engine.sampling import SamplingParams
from apriel2_jax.engine.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig

MAX_LEN = 96


def _pow2(n):
    return 1 << (n - 1).bit_length()


def _padded(rows, longest):
    return _pow2(rows) * _pow2(longest)


def _engine(page_size, max_num_seqs, budget_tokens, chunk, window, extra_pages, decode_steps=1, padded=None,
            snapshots=None):
    """``snapshots``: None without prefix caching, else the size of its snapshot pool."""
    layout = CacheLayout(
        (AttentionFamily("window_%d" % window, window, (1,), 4), AttentionFamily("full", None, (0,), 4)),
        StateFamily((2, 3), 64),
    )
    full_pages = -(-MAX_LEN // page_size) + extra_pages  # tight: forces preemption under load
    budget = (max_num_seqs + 1) * 64 + 10**9
    plan = plan_cache(layout, budget_bytes=budget, page_size=page_size, max_num_seqs=max_num_seqs,
                      max_model_len=MAX_LEN, max_chunk=max(chunk, decode_steps))
    plan = type(plan)(plan.page_size, dict(plan.pages, full=full_pages + 1), plan.table_width, plan.slots, plan.bytes)
    manager = CacheManager(layout, plan)
    config = SchedulerConfig(max_num_seqs, budget_tokens, chunk, 3, decode_steps, MAX_LEN, padded)
    prefix = None
    if snapshots is not None:
        prefix = PrefixCache(manager, prefix_root(("x",), page_size), (plan.slots, snapshots), known_capacity=64)
    return Scheduler(config, manager, prefix)


def _check_step(scheduler, step):
    ids = [row.request.request_id for row in step.rows]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    for row in step.rows:
        assert row.request.status is RequestStatus.RUNNING
        assert row.start == row.request.num_computed and row.length >= 1
        assert row.start + row.length <= row.request.num_tokens
    cfg = scheduler.config
    if step.kind == "decode":
        assert all(row.length == 1 and row.samples for row in step.rows)
        for row in step.rows:
            request = row.request
            assert 1 <= row.budget <= cfg.decode_steps
            assert row.budget <= request.params.max_new_tokens - len(request.output_ids)
            assert request.num_tokens + row.budget <= MAX_LEN
            blocks = scheduler.cache.blocks(request.request_id)
            # Pages exist for every position the step may write.
            held = (blocks.first_page["full"] + len(blocks.tables["full"])) * scheduler.cache.page_size
            assert held >= row.start + row.budget
    else:
        if cfg.padded_size is not None and len(step.rows) > 1:
            assert cfg.padded_size(len(step.rows), max(r.length for r in step.rows)) <= cfg.max_num_batched_tokens
        assert step.num_tokens <= scheduler.config.max_num_batched_tokens
        assert len(step.rows) <= scheduler.config.max_prefill_rows
        assert all(row.length <= scheduler.config.max_chunk for row in step.rows)


def _check_copies(scheduler, saves, restores):
    """Saves read a slot and write a snapshot row; restores the reverse, each into a distinct live slot."""
    slots = scheduler.cache.plan.slots
    for source, destination in saves:
        assert 0 < source < slots <= destination
    for source, destination in restores:
        assert 0 < destination < slots <= source
    assert len({d for _, d in restores}) == len(restores)


def _simulate(scheduler, rng, steps, arrival_rate, abort_rate, prefixes=(), ahead=False):
    """``prefixes``: token lists that prompts start with, half of the time. ``ahead``: as the engine chains
    prefill steps, each prefill step is followed by ``schedule_ahead`` before its sampled tokens are appended
    (that step then runs next, already completed)."""
    next_id = 0
    live = {}
    steps_run = 0
    last_progress = 0
    queued = None  # a step scheduled ahead and completed, whose tokens are not appended yet
    while steps_run < steps or scheduler.has_work or queued is not None:
        arriving = steps_run < steps
        # Offered load stays bounded so that the run measures scheduling, not an ever-growing queue.
        if arriving and len(scheduler.waiting) < 2 * scheduler.config.max_num_seqs and rng.random() < arrival_rate:
            prompt = [rng.randrange(50) for _ in range(rng.randint(1, MAX_LEN // 2))]
            if prefixes and rng.random() < 0.5:
                prefix = rng.choice(prefixes)
                prompt = (prefix[: rng.randint(1, len(prefix))] + prompt)[: MAX_LEN // 2]
            params = SamplingParams(max_new_tokens=rng.randint(1, MAX_LEN - len(prompt) - 1))
            request = Request(next_id, prompt, params)
            live[next_id] = request
            scheduler.add(request)
            next_id += 1
        if arriving and live and rng.random() < abort_rate:
            victim = rng.choice(sorted(live))
            scheduler.abort(victim)
            del live[victim]
            last_progress = steps_run  # the victim's work is discarded: the guard's count restarts
        steps_run += 1
        if queued is not None:
            step, queued, fed = queued, None, {}
        else:
            step = scheduler.schedule()
            if step is None:
                assert not scheduler.running and not scheduler.waiting
                last_progress = steps_run  # idle: nothing waits for progress
                continue
            _check_step(scheduler, step)
            if scheduler.prefix is not None:
                _check_copies(scheduler, *scheduler.prefix.take_copies())
            # A decode row may stop anywhere within its budget (a stop token on the device).
            fed = {row.request: rng.randint(1, row.budget) for row in step.rows if step.kind == "decode"}
            scheduler.complete(step, fed)
        if ahead and step.kind == "prefill":
            queued = scheduler.schedule_ahead()
            if queued is not None:
                _check_step(scheduler, queued)
                assert queued.kind == "prefill" and not queued.preempted
                sampling = {row.request for row in step.rows if row.samples}
                assert not sampling & {row.request for row in queued.rows}, "a row fed before its token is read"
                if scheduler.prefix is not None:
                    _check_copies(scheduler, *scheduler.prefix.take_copies())
                scheduler.complete(queued)
                scheduler.check_invariants()
        for row in step.rows:
            request = row.request
            if not row.samples or request.status is not RequestStatus.RUNNING:  # aborted while queued
                continue
            last_progress = steps_run
            for _ in range(fed.get(request, 1)):
                request.output_ids.append(rng.randrange(50))
            if len(request.output_ids) >= request.params.max_new_tokens or rng.random() < 0.02:
                scheduler.finish(request, "length")
                del live[request.request_id]
        scheduler.check_invariants()
        # Livelock guard (e.g. preemption thrash): some request must produce a token every few hundred steps
        # (counted from the last idle step or abort).
        assert steps_run - last_progress < 300, "no token produced in 300 steps"
    return steps_run


@settings(max_examples=32, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    page_size=st.sampled_from([1, 4, 16]),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(4, 64),
    chunk_fraction=st.floats(0.1, 1.0),
    window=st.integers(1, 40),
    extra_pages=st.integers(0, 12),
    arrival_rate=st.floats(0.1, 0.9),
    abort_rate=st.floats(0.0, 0.1),
    decode_steps=st.integers(1, 5),
    padded=st.booleans(),
    snapshots=st.one_of(st.none(), st.integers(0, 6)),
    ahead=st.booleans(),
)
# One slot, one-token chunks and frequent aborts: long stretches with no token sampled that are not a livelock.
@example(seed=126564, page_size=1, max_num_seqs=1, budget=4, chunk_fraction=0.25, window=1, extra_pages=0,
         arrival_rate=0.109375, abort_rate=0.09765625, decode_steps=1, padded=False, snapshots=None, ahead=False)
def test_random_traffic_keeps_every_invariant(
    seed, page_size, max_num_seqs, budget, chunk_fraction, window, extra_pages, arrival_rate, abort_rate,
    decode_steps, padded, snapshots, ahead,
):
    """Prompts share prefixes half of the time; ``snapshots`` None runs without prefix caching, else with a
    snapshot pool that small; ``ahead``: prefill steps chained (scheduled before the previous one's tokens are
    appended). After every step: refcounts equal table references and published pages are held only at their
    own prefix's index; after draining, nothing is referenced anywhere."""
    chunk = max(1, int(budget * chunk_fraction))
    scheduler = _engine(page_size, max_num_seqs, budget, chunk, window, extra_pages, decode_steps,
                        _padded if padded else None, snapshots=snapshots)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(MAX_LEN // 2)] for _ in range(3)]
    steps = _simulate(scheduler, rng, 500, arrival_rate, abort_rate, prefixes, ahead)
    assert steps >= 500
    # Everything finished or aborted: nothing in use anywhere.
    usage = scheduler.cache.usage()
    assert all(used == 0 for used, _ in usage.values()), usage
    scheduler.check_invariants()
    if scheduler.prefix is not None:
        stats = scheduler.prefix.stats
        assert 0 <= stats.hit_tokens <= stats.query_tokens


def _run_to_completion(scheduler, max_new_tokens: int, steps: int = 10**6) -> list:
    """Schedule and complete steps, each sampled row getting token 1, until no work is left (or ``steps``);
    checks the invariants after every step. Returns the requests preempted, in order."""
    preempted = []
    for _ in range(steps):
        step = scheduler.schedule()
        if step is None:
            break
        preempted += [r.request_id for r in step.preempted]
        if scheduler.prefix is not None:
            scheduler.prefix.take_copies()
        scheduler.complete(step)
        for row in step.rows:
            if row.samples:
                row.request.output_ids.append(1)
                if len(row.request.output_ids) >= max_new_tokens:
                    scheduler.finish(row.request, "length")
        scheduler.check_invariants()
    return preempted


def test_preemption_is_newest_first_and_resumes_by_recompute():
    scheduler = _engine(page_size=4, max_num_seqs=3, budget_tokens=64, chunk=64, window=40, extra_pages=0)
    # Full pool: 24 pages = 96 tokens. Two prompts of 40 tokens fit; their decodes then run out of pages.
    a = Request("a", list(range(40)), SamplingParams(max_new_tokens=50))
    b = Request("b", list(range(40)), SamplingParams(max_new_tokens=50))
    scheduler.add(a)
    scheduler.add(b)
    preempted = _run_to_completion(scheduler, max_new_tokens=50, steps=200)
    assert preempted and preempted[0] == "b"  # the newest goes first
    assert a.finish_reason == b.finish_reason == "length"
    assert b.num_preemptions >= 1 and len(b.output_ids) == 50


def test_abort_releases_everything():
    scheduler = _engine(page_size=4, max_num_seqs=2, budget_tokens=16, chunk=8, window=5, extra_pages=4)
    for i in range(3):
        scheduler.add(Request(i, list(range(30)), SamplingParams(max_new_tokens=5)))
    step = scheduler.schedule()
    scheduler.complete(step)
    assert scheduler.running
    for i in range(3):
        assert scheduler.abort(i) is not None
    assert scheduler.abort(99) is None
    assert all(used == 0 for used, _ in scheduler.cache.usage().values())
    scheduler.check_invariants()


def test_cached_pages_are_evicted_under_pressure_and_hits_still_resume_correctly():
    """Distinct prompts through a tight pool evict cached pages and snapshots; the last three share a prefix
    and hit each other (the second at the first's chunk end 16, the third at the branch point 20)."""
    scheduler = _engine(page_size=4, max_num_seqs=2, budget_tokens=16, chunk=8, window=5, extra_pages=2,
                        snapshots=3)
    rng = random.Random(0)
    shared = [rng.randrange(50) for _ in range(20)]
    for i in range(12):
        tokens = shared + [i] * 5 if i >= 9 else [rng.randrange(50) for _ in range(30)]
        scheduler.add(Request(i, tokens, SamplingParams(max_new_tokens=3)))
        _run_to_completion(scheduler, max_new_tokens=3)
    assert scheduler.cache.pools["full"].evictions > 0 and scheduler.prefix.snapshots.evictions > 0
    assert scheduler.prefix.stats.hit_tokens == 16 + 20
    assert all(used == 0 for used, _ in scheduler.cache.usage().values())


def _prefill_then_sample(scheduler, *requests):
    """Prefill the waiting ``requests`` in one step and give each its first sampled token."""
    step = scheduler.schedule()
    assert step.kind == "prefill" and [row.request for row in step.rows] == list(requests)
    scheduler.complete(step)
    for request in requests:
        request.output_ids.append(1)


def _decode(scheduler) -> dict:
    """One decode step, every row running its whole budget; returns {request id: budget}."""
    step = scheduler.schedule()
    assert step.kind == "decode"
    budgets = {row.request.request_id: row.budget for row in step.rows}
    scheduler.complete(step, {row.request: row.budget for row in step.rows})
    for row in step.rows:
        row.request.output_ids.extend([1] * row.budget)
    return budgets


def test_decode_dispatches_are_long_only_while_nobody_waits():
    """decode_steps tokens per dispatch with nothing waiting; a short dispatch (decode_steps_while_prefilling)
    while a waiting request could be admitted, so its prefill is not held back by a long device loop."""
    scheduler = _engine(page_size=4, max_num_seqs=3, budget_tokens=64, chunk=64, window=40, extra_pages=40,
                        decode_steps=16)
    assert scheduler.config.decode_steps_while_prefilling == 4
    a = Request("a", list(range(8)), SamplingParams(max_new_tokens=60))
    scheduler.add(a)
    _prefill_then_sample(scheduler, a)
    assert _decode(scheduler) == {"a": 16}
    b = Request("b", list(range(8)), SamplingParams(max_new_tokens=60))
    scheduler.add(b)
    _prefill_then_sample(scheduler, b)  # a prefill comes first: the last step was a decode
    c = Request("c", list(range(8)), SamplingParams(max_new_tokens=60))
    scheduler.add(c)
    assert _decode(scheduler) == {"a": 4, "b": 4}  # c waits and a slot is free: short
    _prefill_then_sample(scheduler, c)
    assert _decode(scheduler) == {"a": 16, "b": 16, "c": 16}  # nothing waits any more


def test_with_every_slot_taken_a_dispatch_ends_at_the_first_known_finish():
    """Waiting requests that cannot be admitted get the slot of the first running request to reach its token
    limit as soon as it does: the dispatch ends there (rounded up to the device loop's stop-check group)."""
    scheduler = _engine(page_size=4, max_num_seqs=2, budget_tokens=64, chunk=64, window=40, extra_pages=40,
                        decode_steps=16)
    a = Request("a", list(range(8)), SamplingParams(max_new_tokens=60))
    b = Request("b", list(range(8)), SamplingParams(max_new_tokens=7))
    for request in (a, b):
        scheduler.add(request)
    _prefill_then_sample(scheduler, a, b)
    scheduler.add(Request("c", list(range(8)), SamplingParams(max_new_tokens=60)))
    # b has 6 tokens left: the dispatch runs 8 (two groups of 4), b stopping at its 6.
    assert _decode(scheduler) == {"a": 8, "b": 6}


def test_a_partly_prefilled_prompt_keeps_decode_dispatches_short():
    scheduler = _engine(page_size=4, max_num_seqs=3, budget_tokens=8, chunk=8, window=40, extra_pages=40,
                        decode_steps=16)
    a = Request("a", list(range(8)), SamplingParams(max_new_tokens=60))
    scheduler.add(a)
    _prefill_then_sample(scheduler, a)
    assert _decode(scheduler) == {"a": 16}
    b = Request("b", list(range(20)), SamplingParams(max_new_tokens=60))
    scheduler.add(b)
    step = scheduler.schedule()
    assert step.kind == "prefill" and step.rows[0].length == 8  # b's first chunk of three
    scheduler.complete(step)
    assert _decode(scheduler) == {"a": 4}


def test_a_waiting_request_without_pages_does_not_shorten_dispatches():
    """A free slot but no pages for the waiting prompt: the prefill attempt schedules nothing, so decode
    dispatches are not cut short for it (only to the first running request's finish)."""
    # 24 pages of 4 tokens: a and b hold 4 each and their 16-token budgets 5 more; c's 70 tokens need 18.
    scheduler = _engine(page_size=4, max_num_seqs=3, budget_tokens=96, chunk=96, window=40, extra_pages=0,
                        decode_steps=16)
    a = Request("a", list(range(16)), SamplingParams(max_new_tokens=20))
    b = Request("b", list(range(16)), SamplingParams(max_new_tokens=20))
    for request in (a, b):
        scheduler.add(request)
    _prefill_then_sample(scheduler, a, b)
    scheduler.add(Request("c", list(range(70)), SamplingParams(max_new_tokens=5)))
    assert _decode(scheduler) == {"a": 4, "b": 4}  # the last prefill attempt admitted: c might fit
    # The next attempt finds no pages for c: the dispatch runs to the first finish (15 tokens left each).
    assert _decode(scheduler) == {"a": 15, "b": 15}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_prefill_scheduled_ahead_skips_rows_awaiting_their_token_and_stops_once_a_request_decodes():
    """Behind a completed prefill step whose tokens are not read: the next prefill continues the prompts still
    pending and admits new ones, never feeds a row waiting for its sampled token, and yields to decoding."""
    scheduler = _engine(page_size=4, max_num_seqs=3, budget_tokens=12, chunk=8, window=40, extra_pages=40)
    a = Request("a", list(range(4)), SamplingParams(max_new_tokens=5))
    b = Request("b", list(range(20)), SamplingParams(max_new_tokens=5))
    c = Request("c", list(range(6)), SamplingParams(max_new_tokens=5))
    for request in (a, b, c):
        scheduler.add(request)
    first = scheduler.schedule()
    assert [(row.request.request_id, row.length, row.samples) for row in first.rows] == [("a", 4, True),
                                                                                          ("b", 8, False)]
    scheduler.complete(first)
    assert a.pending == 0  # its token is not read yet: neither kind may schedule it
    ahead = scheduler.schedule_ahead()
    assert [(row.request.request_id, row.start, row.length) for row in ahead.rows] == [("b", 8, 8), ("c", 0, 4)]
    scheduler.complete(ahead)
    a.output_ids.append(1)  # the first step's token read: a decodes, so nothing more is scheduled ahead
    assert scheduler.schedule_ahead() is None
    assert scheduler.schedule().kind == "decode"


def test_prefill_scheduled_ahead_never_preempts():
    """Pages short for the next chunk: ``schedule`` preempts the newest request, ``schedule_ahead`` schedules
    nothing (the unread step may be about to finish a request and free its pages)."""
    scheduler = _engine(page_size=4, max_num_seqs=3, budget_tokens=64, chunk=64, window=40, extra_pages=0)
    old = Request("old", list(range(40)), SamplingParams(max_new_tokens=1))
    scheduler.add(old)
    step = scheduler.schedule()
    scheduler.complete(step)
    # 24 pages of 4 tokens: "old" holds 10; a 60-token prompt's first chunk of 56 fits.
    new = Request("new", list(range(60)), SamplingParams(max_new_tokens=1))
    scheduler.add(new)
    scheduler.config = dataclasses.replace(scheduler.config, max_chunk=56)
    step = scheduler.schedule_ahead()
    assert [row.request.request_id for row in step.rows] == ["new"] and step.rows[0].length == 56
    scheduler.complete(step)
    # "old" still waits for its token (the first step is unread), holding its 10 pages; new's last 4 tokens need a
    # 25th page.
    assert old.pending == 0 and new.pending == 4
    assert scheduler.schedule_ahead() is None
    assert old.status is new.status is RequestStatus.RUNNING and not old.preemptions and not new.preemptions
    scheduler.check_invariants()
    assert [r.request_id for r in scheduler.schedule().preempted] == ["new"]  # what scheduling now would do


def test_prefill_scheduled_ahead_admits_nobody_while_a_running_prompt_waits_for_pages():
    """A running prompt whose next chunk finds no pages ends the step scheduled ahead: a newcomer whose first
    chunk would fit does not take the pages first."""
    scheduler = _engine(page_size=4, max_num_seqs=3, budget_tokens=64, chunk=64, window=40, extra_pages=0)
    scheduler.config = dataclasses.replace(scheduler.config, max_chunk=40)
    old = Request("old", list(range(40)), SamplingParams(max_new_tokens=1))
    long = Request("long", list(range(60)), SamplingParams(max_new_tokens=1))
    for request in (old, long):
        scheduler.add(request)
    step = scheduler.schedule()  # old whole (10 pages), long's first 24 tokens (6 pages): the budget of 64
    assert [(row.request.request_id, row.length) for row in step.rows] == [("old", 40), ("long", 24)]
    scheduler.complete(step)
    scheduler.add(Request("small", list(range(8)), SamplingParams(max_new_tokens=1)))
    # 24 pages: 8 free; long's next 36 tokens need 9, small's 8 tokens need 2.
    assert scheduler.schedule_ahead() is None
    assert [r.request_id for r in scheduler.waiting] == ["small"] and not scheduler.cache.holds("small")
    scheduler.check_invariants()
