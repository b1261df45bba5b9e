"""The serving engine end to end on the golden checkpoints: paged caches, chunked prefill, batching,
preemption and placements must all reproduce the reference's greedy tokens."""

import os
import re
import time

import jax
import numpy as np
import pytest

from apriel2_jax.engine import cache_manager
from apriel2_jax.engine.cache_layout import cache_layout, plan_cache
from apriel2_jax.engine.llm import LLM
from apriel2_jax.engine.sampling import SamplingParams
from apriel2_jax.engine.step import DEVICE_STOP_IDS, STEPS_PER_STOP_CHECK, Buckets, StepRunner, build_inputs
from apriel2_jax.engine.scheduler import ScheduledStep
from apriel2_jax.parity import load_case
from apriel2_jax.placement import resolve_placement
from tests.conftest import GOLDENS, golden_cases
from tests.helpers import golden_model

GREEDY = SamplingParams.greedy(max_new_tokens=8, ignore_eos=True)
SMALL = dict(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16, max_chunk=8, max_prefill_rows=2,
             page_size=4, cache_bytes=4 * 2**20, warm_up=False, log=lambda msg: None)


def _prompts(case, rows=(0, 1)):
    return [[int(t) for t in case.input_ids[r, : case.prompt_len]] for r in rows]


@pytest.mark.parametrize("case_name", golden_cases())
def test_engine_greedy_matches_goldens_for_every_placement(case_name):
    directory = os.path.join(GOLDENS, case_name)
    case = load_case(directory)
    llm = LLM(directory, dtype="float32", buckets=Buckets((2,), (2,), (8,)), debug_checks=True, **SMALL)
    for name in case.placements:
        llm.set_placement(name)
        outputs = llm.generate(_prompts(case), GREEDY)
        got = np.array([o.token_ids for o in outputs])
        np.testing.assert_array_equal(got, case.greedy_ids[name], err_msg=f"{case_name}/{name}")
        assert all(o.finish_reason == "length" for o in outputs)
        assert llm.cache_manager.usage() == {k: (0, v[1]) for k, v in llm.cache_manager.usage().items()}


@pytest.fixture(scope="module")
def hybrid():
    """hybrid_all_mixers under the 'mamba' placement: attention, sliding window 8, GDN, KDA and Mamba layers."""
    return golden_model("hybrid_all_mixers")


def _engine(hybrid, **overrides):
    case, model, runner = hybrid
    args = dict(SMALL, model=model, dtype="float32", placements=case.placements, placement="mamba",
                step_runner=runner, debug_checks=True, max_num_seqs=4, max_prefill_rows=4,
                buckets=Buckets((4,), (4,), (1, 4, 8, 32)))
    args.update(overrides)
    return LLM(**args)


@pytest.mark.parametrize("chunk", [1, 3, 7, 32])
def test_prefill_chunk_size_does_not_change_tokens(hybrid, chunk):
    case = hybrid[0]
    llm = _engine(hybrid, max_chunk=chunk, max_num_batched_tokens=32)
    outputs = llm.generate(_prompts(case), GREEDY)
    np.testing.assert_array_equal(np.array([o.token_ids for o in outputs]), case.greedy_ids["mamba"])


def test_alone_and_batched_with_other_lengths_agree(hybrid):
    case = hybrid[0]
    llm = _engine(hybrid)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in _prompts(case)]
    others = [[5, 9, 13], [int(t) for t in case.input_ids[1, :26]], [7] * 11]
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_new_tokens=4), GREEDY, GREEDY,
              SamplingParams.greedy(max_new_tokens=3)]
    batch = llm.generate([_prompts(case)[0], others[0], others[1], _prompts(case)[1], others[2]], params)
    assert batch[0].token_ids == alone[0] and batch[3].token_ids == alone[1]
    assert [len(o.token_ids) for o in batch] == [8, 4, 6, 8, 3]  # others[1] reaches max_model_len (32)
    assert batch[2].finish_reason == "length"
    np.testing.assert_array_equal(np.array(alone), case.greedy_ids["mamba"])


@pytest.mark.parametrize("usable_pages, where, decode_steps", [(10, "prefill", 8), (13, "decode", 1), (12, "decode", 8)])
def test_preemption_mid_prefill_and_mid_decode_gives_the_same_tokens(hybrid, usable_pages, where, decode_steps):
    """Four requests of 21 + 8 tokens (8 pages of 4 each) share 10, 12 or 13 pages of full attention: with 10,
    two prompts never both finish prefilling; with 12 or 13 they do, and decoding then runs out of pages (with
    several decode steps per dispatch a row that cannot get pages for all of them runs one step, so only a
    full pool preempts)."""
    case, model, _ = hybrid
    placement = resolve_placement(model.config, "mamba", case.placements)
    layout = cache_layout(model.config, placement, 4)
    # The engine sizes window block tables for two chained decode dispatches, or a prefill chunk if longer.
    roomy = plan_cache(layout, budget_bytes=2**30, page_size=4, max_num_seqs=4, max_model_len=32,
                       max_chunk=max(8, 2 * decode_steps))
    full = next(f for f in layout.attention if f.window is None)
    fixed = sum(v for k, v in roomy.bytes.items() if k != "full")
    llm = _engine(hybrid, cache_bytes=fixed + (usable_pages + 1) * 4 * full.token_bytes, decode_steps=decode_steps)
    assert llm.plan.pages["full"] == usable_pages + 1
    outputs = llm.generate(_prompts(case) * 2, GREEDY)
    expected = np.concatenate([case.greedy_ids["mamba"]] * 2)
    np.testing.assert_array_equal(np.array([o.token_ids for o in outputs]), expected)
    points = [(cached, generated) for o in outputs for cached, generated in o.preemptions]
    assert llm.stats.preemptions == len(points) > 0
    if where == "prefill":
        assert any(generated == 0 and 0 < cached < case.prompt_len for cached, generated in points), points
    else:
        assert any(generated > 0 for cached, generated in points), points


def test_no_recompilation_after_warm_up(hybrid):
    llm = _engine(hybrid, warm_up=True, buckets=Buckets((1, 4), (4,), (8,)))
    compiled = llm.runner.compilations
    builds = llm.cache_manager.metadata_builds
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 100, size=n)) for n in (1, 5, 9, 17, 23, 2, 30)]
    params = [SamplingParams(temperature=0.5, top_k=5, seed=i, max_new_tokens=int(m)) for i, m in enumerate([1, 7, 3, 12, 5, 20, 1])]
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [1, 7, 3, 12, 5, 20, 1]
    assert llm.runner.compilations == compiled
    # One metadata build per step, shared by every layer (vLLM rebuilt it per KV-cache group).
    assert llm.cache_manager.metadata_builds - builds == llm.stats.steps > 0


def test_buckets_larger_than_the_state_slots_stay_in_bounds(hybrid):
    case = hybrid[0]
    llm = _engine(hybrid, max_num_seqs=2, buckets=Buckets((8,), (8,), (8,)), warm_up=True)
    assert llm.plan.slots == 3  # two live slots and the sink, while a bucket has 8 rows
    inputs = build_inputs(ScheduledStep("decode", (), ()), (8, 1), llm.cache_manager)
    col = inputs.layout.columns
    assert (inputs.ints[:, col["slot"]] == 0).all() and (inputs.ints[:, col["length"]] == 0).all()
    assert all((inputs.ints[:, col[f"tables/{f}"]] == 0).all() for f, _ in inputs.layout.table_widths)
    # Warm-up ran every bucket on padding only: live slots and pages are untouched (still zero).
    for layer in llm._cache:
        for array in layer.values():
            assert not np.asarray(array)[1:].any()
    outputs = llm.generate(_prompts(case), GREEDY)
    np.testing.assert_array_equal(np.array([o.token_ids for o in outputs]), case.greedy_ids["mamba"])


def test_switching_placement_clears_caches_and_reuses_compiled_steps(hybrid):
    case = hybrid[0]
    llm = _engine(hybrid, buckets=Buckets((4,), (4,), (8,)))
    first = llm.generate(_prompts(case), GREEDY)
    llm.set_placement("kda")
    kda = llm.generate(_prompts(case), GREEDY)
    np.testing.assert_array_equal(np.array([o.token_ids for o in kda]), case.greedy_ids["kda"])
    compiled = llm.runner.compilations
    llm.set_placement("mamba")
    again = llm.generate(_prompts(case), GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert llm.runner.compilations == compiled


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_num_seqs=4, num_state_slots=2), "max_num_seqs=4 exceeds num_state_slots=2"),
        (dict(max_chunk=64, max_num_batched_tokens=16), "max_chunk=64 exceeds max_num_batched_tokens=16"),
        (dict(cache_bytes=1024), "raise the memory budget"),
    ],
)
def test_start_up_errors_say_what_to_change(hybrid, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _engine(hybrid, **kwargs)


def test_prompt_longer_than_context_is_rejected(hybrid):
    llm = _engine(hybrid)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[3] * 40], GREEDY)


@pytest.mark.parametrize("as_array", [False, True])
def test_prompt_ids_outside_the_vocabulary_are_named(hybrid, as_array):
    llm = _engine(hybrid)
    vocab = llm.config.vocab_size
    prompt = [5, vocab, 7, -1, 9]
    with pytest.raises(ValueError, match=rf"token ids \[{vocab}, -1\] are outside the vocabulary \[0, {vocab}\)"):
        llm.add_request(np.array(prompt, np.int64) if as_array else prompt, GREEDY)
    assert not llm.has_unfinished_requests


def test_prompts_as_lists_numpy_arrays_and_numpy_scalars_give_the_same_tokens(hybrid):
    case = hybrid[0]
    llm = _engine(hybrid)
    prompt = _prompts(case)[0]
    forms = [prompt, np.array(prompt, np.int32), [np.int64(t) for t in prompt]]
    outputs = [llm.generate([form], GREEDY)[0] for form in forms]
    assert all(o.prompt_ids == prompt and type(o.prompt_ids[0]) is int for o in outputs)
    assert all(o.token_ids == case.greedy_ids["mamba"][0].tolist() for o in outputs)


def test_several_decode_steps_per_dispatch_give_the_same_tokens_as_one(hybrid):
    """Greedy, seeded top-k/top-p sampling, stop ids hit mid-dispatch, budgets ending mid-dispatch and the
    context limit: a dispatch of up to 6 decode steps per row reproduces one step per dispatch exactly."""
    case = hybrid[0]
    rng = np.random.default_rng(1)
    prompts = _prompts(case) + [[int(t) for t in rng.integers(3, 100, size=n)] for n in (3, 26, 9)]
    # Without prefix caching: the reference run would turn into a hit and move where prefill hands over to decode.
    # Without chaining: a chained dispatch delays the fifth request's admission by a dispatch, which puts its
    # prefill in another batch (float32 logprobs then move by ~1e-6; chaining has tests of its own).
    one = _engine(hybrid, decode_steps=1, enable_prefix_caching=False, chain_decode=False)
    reference = one.generate(prompts[:1], GREEDY)[0].token_ids
    stop_id = reference[4]  # the greedy run of prompt 0 emits it at its fifth token
    params = [SamplingParams.greedy(max_new_tokens=8, stop_token_ids=(stop_id,)),
              SamplingParams(temperature=0.9, top_k=7, top_p=0.8, seed=5, max_new_tokens=7),
              SamplingParams(temperature=1.1, seed=9, max_new_tokens=6),
              SamplingParams.greedy(max_new_tokens=12, ignore_eos=True),  # 26 + 12 > max_model_len 32
              SamplingParams.greedy(max_new_tokens=3, logprobs=True)]
    expected = one.generate(prompts, params)
    many = _engine(hybrid, decode_steps=6, enable_prefix_caching=False, chain_decode=False)  # 3 groups of 2
    got = many.generate(prompts, params)
    for e, g in zip(expected, got):
        assert (g.token_ids, g.finish_reason) == (e.token_ids, e.finish_reason)
    np.testing.assert_allclose(got[4].logprobs, expected[4].logprobs, rtol=1e-6)
    assert got[0].token_ids == reference[:5] and got[0].finish_reason == "stop"
    assert got[3].finish_reason == "length" and len(got[3].token_ids) == 32 - 26
    assert many.stats.decode_dispatches < one.stats.decode_dispatches
    assert many.stats.decode_tokens == one.stats.decode_tokens - len(reference) + 1  # one also ran the reference


@pytest.mark.parametrize("decode_steps, stop_checks, group",
                         [(16, True, STEPS_PER_STOP_CHECK), (2, True, 2), (16, False, 16)])
def test_decode_loop_reads_no_predicate_on_the_host_between_stop_checks(hybrid, decode_steps, stop_checks, group):
    """The device loop over decode iterations runs in groups of a trip count XLA knows (so the runtime needs no
    host read of a loop predicate per iteration); only the loop over groups, which stops early once every row has
    stopped, has none. Without stop checks (the variant chained dispatches use) the whole loop is one group."""
    runner = hybrid[2]
    llm = _engine(hybrid, decode_steps=decode_steps)
    inputs = build_inputs(ScheduledStep("prefill", (), ()), (4, 1), llm.cache_manager)
    leaves, tree = jax.tree.flatten(llm._cache)
    previous = np.zeros((2 * decode_steps + 3, 4), np.int32)
    compiled = runner._decode_step.lower(
        runner.param_leaves, leaves, inputs.ints, inputs.floats, previous, cache_tree=tree, cache_specs=None,
        layout=inputs.layout, placement=llm.placement, decode_steps=decode_steps, filters=False, logprobs=False,
        stop_checks=stop_checks).compile()
    carried = leaves[0]  # every cache array is carried through the decode loop
    cache_shape = f"f32[{','.join(map(str, carried.shape))}]"
    trip_counts = [re.search(r'known_trip_count":\{"n":"(\d+)"', line)
                   for line in compiled.as_text().splitlines() if " while(" in line and cache_shape in line]
    trip_counts = [int(m.group(1)) if m else None for m in trip_counts]
    expected = [group] if group == decode_steps else [group, None]
    assert sorted(trip_counts, key=str) == sorted(expected, key=str), trip_counts


def test_chained_decode_dispatches_give_the_same_tokens_as_one_at_a_time(hybrid):
    """Decode dispatches queued before the host reads the one before (each row's token and stop taken from it on
    the device) reproduce one dispatch at a time: greedy and seeded top-k/top-p sampling, a stop id hit while the
    next dispatch is already queued, the context limit, and more requests than slots (a waiting request is
    admitted once a row finishes, and chaining resumes after)."""
    case = hybrid[0]
    rng = np.random.default_rng(2)
    prompts = _prompts(case) + [[int(t) for t in rng.integers(3, 100, size=n)] for n in (3, 14, 9)]
    # Without prefix caching: the reference run would turn into a hit and move where prefill hands over to decode.
    plain = _engine(hybrid, decode_steps=2, chain_decode=False, enable_prefix_caching=False)
    reference = plain.generate(prompts[:1], SamplingParams.greedy(max_new_tokens=12, ignore_eos=True))[0].token_ids
    stop_id = reference[6]  # the seventh token: the second iteration of the third decode dispatch
    params = [SamplingParams.greedy(max_new_tokens=12, stop_token_ids=(stop_id,), ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=7, top_p=0.8, seed=5, max_new_tokens=11, logprobs=True),
              SamplingParams(temperature=1.1, seed=9, max_new_tokens=13, ignore_eos=True),
              SamplingParams.greedy(max_new_tokens=30, ignore_eos=True),  # 14 + 30 > max_model_len 32
              SamplingParams.greedy(max_new_tokens=9, ignore_eos=True, logprobs=True)]
    expected = plain.generate(prompts, params)
    assert plain.stats.chained_dispatches == 0
    chained = _engine(hybrid, decode_steps=2, enable_prefix_caching=False)
    got = chained.generate(prompts, params)
    for e, g in zip(expected, got):
        assert (g.token_ids, g.finish_reason) == (e.token_ids, e.finish_reason)
    for i in (1, 4):
        np.testing.assert_allclose(got[i].logprobs, expected[i].logprobs, rtol=1e-6)
    assert got[0].token_ids == reference[: reference.index(stop_id) + 1] and got[0].finish_reason == "stop"
    assert got[3].finish_reason == "length" and len(got[3].token_ids) == 32 - 14
    assert chained.stats.chained_dispatches > 0
    assert chained.stats.decode_tokens == plain.stats.decode_tokens - len(reference) + 1
    assert all(used == 0 for used, _ in chained.cache_manager.usage().values())


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_chained_prefill_steps_give_the_same_tokens_as_one_at_a_time(hybrid, prefix_caching):
    """Prompts arriving together prefill in steps each queued before the host reads the one before: the same
    tokens and log-probabilities as one step at a time, for greedy and seeded sampling, requests that end at
    their prefill's sample, chunked prompts, more prompts than slots, and (with prefix caching) a repeated
    prompt whose prefix is computed by a step not read yet."""
    case = hybrid[0]
    rng = np.random.default_rng(4)
    prompts = _prompts(case) + [[int(t) for t in rng.integers(3, 100, size=n)] for n in (3, 14, 9, 5)]
    prompts.append(prompts[0])
    params = [GREEDY,
              SamplingParams(temperature=0.9, top_k=7, seed=5, max_new_tokens=1, logprobs=True),
              SamplingParams.greedy(max_new_tokens=1, logprobs=True),
              SamplingParams(temperature=1.1, seed=9, max_new_tokens=5, ignore_eos=True, logprobs=True),
              SamplingParams.greedy(max_new_tokens=1),
              SamplingParams.greedy(max_new_tokens=3, ignore_eos=True),
              GREEDY]
    plain = _engine(hybrid, chain_prefill=False, enable_prefix_caching=prefix_caching)
    expected = plain.generate(prompts, params)
    chained = _engine(hybrid, enable_prefix_caching=prefix_caching)
    got = chained.generate(prompts, params)
    for e, g in zip(expected, got):
        assert (g.token_ids, g.finish_reason) == (e.token_ids, e.finish_reason)
        if e.logprobs is not None:
            np.testing.assert_allclose(g.logprobs, e.logprobs, rtol=1e-5)
    assert got[0].token_ids == case.greedy_ids["mamba"][0].tolist()
    assert got[-1].token_ids == got[0].token_ids
    assert plain.stats.chained_prefills == 0 and chained.stats.chained_prefills > 0
    assert chained._in_flight is None and all(used == 0 for used, _ in chained.cache_manager.usage().values())


def test_an_abort_while_a_chained_prefill_step_is_queued_frees_its_pages(hybrid):
    """The incremental API aborts a request whose next prefill chunk is queued but not read: the other
    request's tokens are unchanged and nothing stays allocated."""
    case = hybrid[0]
    prompts = _prompts(case)
    params = SamplingParams.greedy(max_new_tokens=4, ignore_eos=True)
    expected = _engine(hybrid, chain_prefill=False).generate(prompts[:1], params)[0].token_ids
    llm = _engine(hybrid, max_num_batched_tokens=8, max_chunk=4)  # 4-token chunks of both prompts per step
    keep, doomed = llm.add_request(prompts[0], params), llm.add_request(prompts[1], params)
    events = llm.step()
    assert llm._in_flight is not None and llm._in_flight.step.kind == "prefill" and not events
    assert llm.abort(doomed)
    while llm.has_unfinished_requests:
        events += llm.step()
    assert [e.output.token_ids for e in events if e.finished] == [expected]
    assert llm.stats.chained_prefills > 0
    assert all(used == 0 for used, _ in llm.cache_manager.usage().values())


def test_a_stop_inside_a_dispatch_drops_the_chained_one_and_frees_its_pages(hybrid):
    """One request alone chains every dispatch; when it stops at a stop id, the dispatch already queued behind the
    stop runs its row as padding and its results are dropped: the output ends at the stop, nothing stays
    allocated, and the engine serves the next request as if nothing had been queued."""
    case = hybrid[0]
    prompt = _prompts(case)[0]
    greedy = SamplingParams.greedy(max_new_tokens=14, ignore_eos=True)
    reference = _engine(hybrid, decode_steps=2, chain_decode=False).generate([prompt], greedy)[0].token_ids
    stop = SamplingParams.greedy(max_new_tokens=14, stop_token_ids=(reference[8],), ignore_eos=True)
    llm = _engine(hybrid, decode_steps=2)
    events = list(llm.stream([prompt], stop))
    output = events[-1].output
    assert output.token_ids == reference[: reference.index(reference[8]) + 1] and output.finish_reason == "stop"
    assert [t for e in events for t in e.new_token_ids] == output.token_ids
    assert llm.stats.chained_dispatches > 0 and llm._in_flight is None
    assert all(used == 0 for used, _ in llm.cache_manager.usage().values())
    assert llm.generate([prompt], greedy)[0].token_ids == reference


def test_a_row_that_stops_leaves_the_chain_and_the_others_go_on_chained(hybrid):
    """Two requests, nobody waiting: the first stops at its fourth token; the dispatch already queued runs it as
    padding, and the ones after leave it out (the other request moves from row 1 to row 0, its token still read
    from its own row) without a dispatch read before the next is queued."""
    case = hybrid[0]
    first_prompt, second_prompt = _prompts(case)
    greedy = SamplingParams.greedy(max_new_tokens=13, ignore_eos=True)
    settings = dict(decode_steps=2, enable_prefix_caching=False, max_model_len=48)
    reference = _engine(hybrid, chain_decode=False, **settings).generate([first_prompt, second_prompt], greedy)
    stops = SamplingParams.greedy(max_new_tokens=13, stop_token_ids=(reference[0].token_ids[3],), ignore_eos=True)
    llm = _engine(hybrid, **settings)
    got = llm.generate([first_prompt, second_prompt], [stops, greedy])
    first = reference[0].token_ids
    assert got[0].token_ids == first[: first.index(first[3]) + 1] and got[0].finish_reason == "stop"
    assert got[1].token_ids == reference[1].token_ids
    # Prefill gave each request its first token; six dispatches of two decode the other's 12: only the first
    # was scheduled and read before the next was queued.
    assert llm.stats.decode_dispatches == 6 and llm.stats.chained_dispatches == 5


def test_window_block_tables_hold_a_chained_dispatchs_pages(hybrid):
    """A chained dispatch's pages are allocated while the dispatch before it holds its own: a sliding-window
    family's block table must hold both (here decode dispatches of 8 against prefill chunks of 8)."""
    settings = dict(decode_steps=8, max_chunk=8, max_num_batched_tokens=16, enable_prefix_caching=False)
    params = SamplingParams.greedy(max_new_tokens=20, ignore_eos=True)
    expected = _engine(hybrid, chain_decode=False, **settings).generate([[5, 9, 13, 17, 21]], params)
    llm = _engine(hybrid, **settings)
    assert llm.generate([[5, 9, 13, 17, 21]], params)[0].token_ids == expected[0].token_ids
    assert llm.stats.chained_dispatches > 0


def test_decode_time_leaves_out_the_time_the_caller_holds_control(hybrid):
    """A chained dispatch is timed from the read of the one before; time the caller spends between steps (the
    device may be idle by then) is not device time."""
    llm = _engine(hybrid, decode_steps=2, enable_prefix_caching=False)
    llm.add_request([5, 9, 13, 17, 21], SamplingParams.greedy(max_new_tokens=12, ignore_eos=True))
    while llm._in_flight is None:
        llm.step()
    before = llm.stats.decode_seconds
    time.sleep(1.0)
    llm.step()  # reads the chained dispatch, done long ago
    assert llm.stats.decode_seconds - before < 0.5


def test_without_chaining_a_dispatch_still_stops_early_once_every_row_has_stopped(hybrid):
    """With chaining off, dispatches keep their stop checks: rows that all stop at a stop id end the device
    loop at the next check instead of running every iteration."""
    case = hybrid[0]
    prompt = _prompts(case)[0]
    reference = _engine(hybrid, decode_steps=8).generate([prompt], GREEDY)[0].token_ids
    # 12 tokens: the first decode dispatch's budget is all 8 steps; the stop comes at its second
    stop = SamplingParams.greedy(max_new_tokens=12, stop_token_ids=(reference[2],), ignore_eos=True)
    llm = _engine(hybrid, decode_steps=8, chain_decode=False)
    assert llm.generate([prompt], stop)[0].token_ids == reference[: reference.index(reference[2]) + 1]
    assert llm.stats.decode_dispatches == 1 and llm.stats.decode_steps < 8  # ended at a stop check


def test_no_dispatch_is_chained_while_a_request_waits(hybrid):
    """A request waiting for a slot takes the slot of the first row that stops: a dispatch chained behind that
    stop would hold its prefill back a whole dispatch, so nothing is chained while one waits (and chaining
    resumes once it is admitted)."""
    case = hybrid[0]
    llm = _engine(hybrid, decode_steps=2, max_num_seqs=2, max_prefill_rows=2, buckets=Buckets((2,), (2,), (8,)),
                  enable_prefix_caching=False)
    waiting_when_chained = []
    chain = llm._chain

    def spy(dispatch):
        queued = chain(dispatch)
        if queued is not None:
            waiting_when_chained.append(len(llm.scheduler.waiting))
        return queued

    llm._chain = spy
    prompts = _prompts(case) + [[5, 9, 13]]
    params = [SamplingParams.greedy(max_new_tokens=n, ignore_eos=True) for n in (7, 13, 9)]
    expected = _engine(hybrid, decode_steps=2, max_num_seqs=2, max_prefill_rows=2, chain_decode=False,
                       buckets=Buckets((2,), (2,), (8,)), enable_prefix_caching=False).generate(prompts, params)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in expected]
    assert waiting_when_chained and not any(waiting_when_chained)


def test_a_step_after_every_queued_row_was_aborted_runs_new_work(hybrid):
    """A server stops stepping once nothing is unfinished: a chained dispatch whose only request was aborted
    stays queued, and the next step (a new request's) must run that request's prefill, not read the stale
    dispatch."""
    case = hybrid[0]
    llm = _engine(hybrid, decode_steps=2, enable_prefix_caching=False)
    params = SamplingParams.greedy(max_new_tokens=12, ignore_eos=True)
    doomed = llm.add_request(_prompts(case)[0], params)
    while llm._in_flight is None:
        llm.step()
    assert llm.abort(doomed) and not llm.has_unfinished_requests
    llm.add_request([5, 9, 13], SamplingParams.greedy(max_new_tokens=1))
    prefilled = llm.stats.prefill_tokens
    events = llm.step()
    assert llm.stats.prefill_tokens == prefilled + 3 and [e.finished for e in events] == [True]
    assert llm._in_flight is None and all(used == 0 for used, _ in llm.cache_manager.usage().values())


def test_chaining_stays_off_where_the_device_cannot_stop_a_row_exactly(hybrid):
    """More stop ids than the device checks: the host finishes the row, so no dispatch is chained behind it."""
    case = hybrid[0]
    llm = _engine(hybrid, decode_steps=2)
    params = SamplingParams.greedy(max_new_tokens=10, stop_token_ids=tuple(range(1, 3 + DEVICE_STOP_IDS)))
    reference = _engine(hybrid, decode_steps=2, chain_decode=False).generate(_prompts(case), params)
    got = llm.generate(_prompts(case), params)
    assert [o.token_ids for o in got] == [o.token_ids for o in reference]
    assert llm.stats.chained_dispatches == 0 and llm.stats.decode_dispatches > 1


def test_an_abort_while_a_chained_dispatch_is_queued_drops_only_that_row(hybrid):
    """The incremental API (a server's loop) can abort a request between steps while a dispatch chained onto its
    row is queued: the other rows' tokens are unchanged and the aborted row's pages are freed."""
    case = hybrid[0]
    prompts = _prompts(case)
    params = SamplingParams.greedy(max_new_tokens=12, ignore_eos=True)
    expected = _engine(hybrid, decode_steps=2, chain_decode=False).generate(prompts[:1], params)[0].token_ids
    llm = _engine(hybrid, decode_steps=2)
    keep, doomed = llm.add_request(prompts[0], params), llm.add_request(prompts[1], params)
    events = []
    while llm._in_flight is None:
        events += llm.step()
    assert llm.abort(doomed)
    while llm.has_unfinished_requests:
        events += llm.step()
    assert [e.output.token_ids for e in events if e.finished] == [expected]
    assert not any(e.index == doomed and e.finished for e in events)
    assert all(used == 0 for used, _ in llm.cache_manager.usage().values())


def test_stream_events_carry_each_dispatch_tokens_and_logprobs(hybrid):
    """A decode dispatch of several steps streams one event per request with all its new tokens (and their
    log-probabilities, for requests that asked): events add up to the outputs, nothing follows a stop."""
    case = hybrid[0]
    prompts = _prompts(case)[:2]
    llm = _engine(hybrid, decode_steps=4, enable_prefix_caching=False)
    reference = llm.generate(prompts[:1], GREEDY)[0].token_ids
    params = [SamplingParams.greedy(max_new_tokens=10, stop_token_ids=(reference[5],), logprobs=True),
              SamplingParams.greedy(max_new_tokens=9)]
    events = list(llm.stream(prompts, params))
    outputs = {e.index: e.output for e in events if e.finished}
    for i, p in enumerate(params):
        mine = [e for e in events if e.index == i]
        assert [t for e in mine for t in e.new_token_ids] == outputs[i].token_ids
        assert mine[-1].finished and not any(e.finished for e in mine[:-1])
        if p.logprobs:
            np.testing.assert_array_equal([x for e in mine for x in e.new_logprobs], outputs[i].logprobs)
        else:
            assert all(e.new_logprobs is None for e in mine)
    assert outputs[0].token_ids == reference[:6] and outputs[0].finish_reason == "stop"
    assert max(len(e.new_token_ids) for e in events) > 1  # several tokens per event


def test_shapes_not_warmed_up_compile_on_first_use_with_a_log_line(hybrid):
    case, model, _ = hybrid
    lines = []
    llm = _engine(hybrid, step_runner=StepRunner(model, log=lines.append), warm_up="few", log=lines.append,
                  buckets=Buckets((1, 2, 4), (4,), (8,)))
    assert llm.runner.compilations == 4  # decode at 1 and at 4 rows, with and without stop checks
    assert any("compiled 4 steps" in line for line in lines)
    lines.clear()
    llm.generate(_prompts(case)[:1], SamplingParams.greedy(max_new_tokens=2))
    assert llm.runner.compilations == 5  # the prefill shape, once
    assert [line for line in lines if line.startswith("compiled step")] == [
        lines[-1]] and "prefill rows=4 tokens=8" in lines[-1]
    # A request asking for log-probabilities runs the sampler variant that computes them, compiled on first use.
    lines.clear()
    (out,) = llm.generate(_prompts(case)[:1], SamplingParams.greedy(max_new_tokens=2, logprobs=True))
    compiled = [line for line in lines if line.startswith("compiled step")]
    assert compiled and all("log-probabilities" in line for line in compiled), compiled
    assert len(out.logprobs) == 2 and all(p <= 0 for p in out.logprobs) and any(p < 0 for p in out.logprobs)


def test_decode_tables_grow_with_the_context_and_give_the_same_tokens(hybrid, monkeypatch):
    """A decode step's block tables span its rows' pages in half-octave widths, not max_model_len: the same
    tokens and log-probabilities as full-width tables while the context crosses several widths (attention and a
    sliding window), each width compiled when first needed."""
    case, model, _ = hybrid
    prompts = [[5, 9, 13], [int(t) for t in case.input_ids[0, :6]]]
    params = SamplingParams(temperature=0.7, seed=11, max_new_tokens=24, ignore_eos=True, logprobs=True)
    # SMALL's max_model_len of 32 tokens is 8 pages of 4, under MIN_FITTED_TABLE_TOKENS: full-width tables
    full = _engine(hybrid, decode_steps=2).generate(prompts, params)
    monkeypatch.setattr(cache_manager, "MIN_FITTED_TABLE_TOKENS", 4)
    lines = []
    llm = _engine(hybrid, decode_steps=2, step_runner=StepRunner(model, log=lines.append), log=lines.append)
    fitted = llm.generate(prompts, params)
    for a, b in zip(full, fitted):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 24
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
    compiled = [re.search(r"tables ([^,)]+)(, no stop checks)?", line).groups()
                for line in lines if line.startswith("compiled step (decode")]
    assert len(compiled) == len(set(compiled)), compiled  # each (widths, loop variant) compiled once
    assert len({widths for widths, _ in compiled}) >= 3, compiled  # e.g. full=2, full=4, full=8 (and the window's)


def test_compile_steps_compiles_the_shapes_asked_for_and_rejects_others(hybrid):
    case, model, _ = hybrid
    llm = _engine(hybrid, step_runner=StepRunner(model), warm_up="none", buckets=Buckets((1, 2, 4), (4,), (8,)))
    llm.compile_steps([(4, 8), (1, 1)])
    assert llm.runner.compilations == 3  # decode with and without stop checks
    llm.generate(_prompts(case)[:1], SamplingParams.greedy(max_new_tokens=1))  # prefill (4, 8) only
    assert llm.runner.compilations == 3
    with pytest.raises(ValueError, match=r"\(3, 1\)"):
        llm.compile_steps([(3, 1)])


def test_default_buckets_never_pad_a_prefill_step_past_the_token_budget():
    buckets = Buckets.default(max_num_seqs=64, max_prefill_rows=64, max_chunk=8192, max_tokens=8192)
    shapes = buckets.prefill_shapes()
    assert all(rows * tokens <= 8192 for rows, tokens in shapes)
    assert (64, 128) in shapes and (1, 8192) in shapes and (8, 1024) in shapes
    assert buckets.pick("prefill", 3, 1000) == (4, 1024)
    assert buckets.pick("prefill", 1, 5000) == (1, 8192)
    with pytest.raises(ValueError, match="no bucket"):
        buckets.pick("prefill", 2, 5000)  # the scheduler never builds it: two rows padded to 8192 each


def test_incremental_api_matches_generate_and_aborts_free_everything():
    """add_request/step/abort (a server's engine loop): requests added between steps produce what generate gives
    them; an aborted request emits no final event and leaves nothing referenced."""
    directory = os.path.join(GOLDENS, "hybrid_all_mixers")
    case = load_case(directory)
    llm = LLM(directory, placements=case.placements, placement="mamba", dtype="float32", max_num_seqs=4,
              max_num_batched_tokens=16, page_size=4, cache_bytes=4 * 2**20, warm_up=False, debug_checks=True,
              log=lambda msg: None)
    prompts = [[int(t) for t in case.input_ids[i, : case.prompt_len]] for i in range(2)] + [[5, 6, 7]]
    params = SamplingParams.greedy(max_new_tokens=5, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    first = llm.add_request(prompts[0], params)
    events = llm.step()
    second = llm.add_request(prompts[1], params)
    doomed = llm.add_request(prompts[2], params)
    assert len({first, second, doomed}) == 3
    events += llm.step()
    assert llm.abort(doomed) and not llm.abort(doomed)
    while llm.has_unfinished_requests:
        events += llm.step()
    outputs = {e.index: e.output for e in events if e.finished}
    assert set(outputs) == {first, second}
    assert [outputs[first].token_ids, outputs[second].token_ids] == expected[:2]
    assert all(used == 0 for used, _ in llm.cache_manager.usage().values())
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([], params)
