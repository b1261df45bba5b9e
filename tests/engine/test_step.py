"""Tests for apriel2_jax.engine.step's device-side helpers (the step itself is tested through the engine in
test_llm.py)."""

from __future__ import annotations

import numpy as np

from apriel2_jax.engine.step import DEVICE_STOP_IDS, _is_stop_id


def test_stop_ids_match_any_column_and_minus_one_is_none():
    rng = np.random.default_rng(0)
    stop_ids = rng.integers(0, 6, size=(64, DEVICE_STOP_IDS)).astype(np.int32)
    stop_ids[rng.random(stop_ids.shape) < 0.4] = -1  # unused columns
    tokens = rng.integers(0, 6, size=64).astype(np.int32)
    expected = np.array([t in set(row) - {-1} for t, row in zip(tokens, stop_ids)])
    assert expected.any() and not expected.all()
    np.testing.assert_array_equal(np.asarray(_is_stop_id(tokens, stop_ids)), expected)
