"""Pages and state rows copied to the host and written back under other ids are bit-identical."""

import os

import numpy as np

from apriel2_jax.engine.kv_connector.transfer import read_rows, write_rows
from apriel2_jax.engine.llm import LLM
from apriel2_jax.engine.sampling import SamplingParams
from apriel2_jax.engine.scheduler import Request
from apriel2_jax.parity import load_case
from tests.conftest import GOLDENS
from tests.engine.test_prefix_cache import ENGINE


def test_pages_and_state_rows_round_trip_through_the_host():
    directory = os.path.join(GOLDENS, "hybrid_all_mixers")
    case = load_case(directory)
    llm = LLM(directory, placements=case.placements, placement="mamba", **ENGINE)
    prompt = [int(t) for t in case.input_ids[0, : case.prompt_len]]
    llm.generate([prompt], SamplingParams.greedy(max_new_tokens=2, ignore_eos=True))
    chain = llm.prefix_cache.chain(Request("probe", prompt, None), len(prompt) // llm.page_size)
    manager = llm.cache_manager
    pages = {f: np.array([pool.lookup(key) for key in chain if pool.lookup(key) is not None])
             for f, pool in manager.pools.items()}
    assert all(len(p) > 0 for p in pages.values())
    snapshot = np.array([llm.prefix_cache.snapshots.lookup(chain[1])])  # the chunk end at 8
    assert snapshot[0] is not None
    values = read_rows(llm._cache, llm.layout, pages, snapshot)
    assert any(np.abs(v).sum() > 0 for v in values.values())
    targets = {f: np.array(manager.pools[f].allocate(len(p))) for f, p in pages.items()}
    slot = np.array([manager.slots.acquire("probe")])
    llm._cache = write_rows(llm._cache, llm.layout, targets, values, slot)
    again = read_rows(llm._cache, llm.layout, targets, slot)
    assert again.keys() == values.keys()
    for name in values:
        np.testing.assert_array_equal(again[name], values[name], err_msg=name)
