"""Tests for apriel2_jax.engine.step's device-side helpers (the step itself is tested through the engine in
test_llm.py)."""

from __future__ import annotations

import jax
import numpy as np

from apriel2_jax.engine.sampling import draw_words, keys_from_words, seeds_to_words
from apriel2_jax.engine.step import DEVICE_STOP_IDS, _dispatch_words, _is_stop_id


def test_stop_ids_match_any_column_and_ignore_unused_ones():
    rng = np.random.default_rng(0)
    stop_ids = rng.integers(0, 6, size=(64, DEVICE_STOP_IDS)).astype(np.int32)
    stop_ids[rng.random(stop_ids.shape) < 0.4] = -1  # unused columns
    tokens = rng.integers(0, 6, size=64).astype(np.int32)
    expected = np.array([t in set(row) - {-1} for t, row in zip(tokens, stop_ids)])
    assert expected.any() and not expected.all()
    np.testing.assert_array_equal(np.asarray(jax.jit(_is_stop_id)(tokens, stop_ids)), expected)


def test_dispatch_words_are_each_steps_key_words():
    """Step i of a dispatch draws with the row's key at generation step counter + i, as when each step derived
    its key itself; counters wrap like the uint32 they are converted to."""
    seeds = seeds_to_words([3, 2**40 + 5, 7, 0])
    counters = np.array([0, 9, 2**31 - 2, -1], np.int32)
    words = np.asarray(jax.jit(_dispatch_words, static_argnums=2)(seeds, counters, 5))
    assert words.shape == (5, 4, 2)
    for i in range(5):
        steps = (counters.astype(np.int64) + i) % 2**32
        expected = np.asarray(draw_words(keys_from_words(seeds, steps.astype(np.uint32))))
        np.testing.assert_array_equal(words[i], expected)
    assert len({tuple(w) for w in words.reshape(-1, 2)}) == 20  # every (step, row) draws its own noise
