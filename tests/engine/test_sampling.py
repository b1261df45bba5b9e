"""Tests for apriel2_jax.engine.sampling: parameter validation, stop conditions, seeds and the jitted sampler."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from apriel2_jax.engine.sampling import (
    GREEDY_TEMPERATURE,
    _gumbel_noise,
    _top_k_mask,
    _top_p_mask,
    SamplingError,
    SamplingParams,
    StopChecker,
    check_stop,
    draw_words,
    make_keys,
    request_seed,
    keys_from_words,
    sample,
    sample_words,
    seeds_to_words,
    stack_params,
)

_sample = jax.jit(sample)

# A fixed 6-token distribution for the statistical tests (no ties, so every filter boundary is unambiguous).
LOGITS6 = np.array([2.0, 1.5, 1.0, 0.3, -0.5, -1.0], np.float32)
N_DRAWS = 20000
TOL = 0.02  # ~5.7 standard deviations of a frequency estimated from 20000 draws (max std is 0.0035).


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _run(logits, temperature, top_k, top_p, seeds, steps=None):
    r = logits.shape[0]
    steps = np.zeros(r, np.int64) if steps is None else steps
    tokens, logprobs = _sample(
        logits,
        np.broadcast_to(np.asarray(temperature, np.float32), (r,)),
        np.broadcast_to(np.asarray(top_k, np.int32), (r,)),
        np.broadcast_to(np.asarray(top_p, np.float32), (r,)),
        make_keys(seeds, steps),
    )
    return np.asarray(tokens), np.asarray(logprobs)


def _frequencies(tokens: np.ndarray, vocab: int) -> np.ndarray:
    return np.bincount(tokens, minlength=vocab) / len(tokens)


# --------------------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "1.0"),
        ("temperature", True),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_p", float("nan")),
        ("max_new_tokens", 0),
        ("max_new_tokens", -3),
        ("max_new_tokens", 4.0),
        ("seed", -1),
        ("seed", 1.5),
        ("seed", 2**64),
        ("seed", False),
        ("stop_token_ids", [1, -2]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", "12"),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop", 7),
        ("ignore_eos", 1),
        ("logprobs", "yes"),
    ],
)
def test_invalid_field_raises_naming_it(field, value):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**{field: value})
    err = info.value
    assert isinstance(err, ValueError)
    assert err.field == field
    assert f"SamplingParams.{field}" in str(err)
    assert "expected" in str(err)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.max_new_tokens) == (1.0, 0, 1.0, None, 16)
    assert p.stop_token_ids == () and p.stop == () and not p.ignore_eos and not p.logprobs

    q = SamplingParams(temperature=1, top_k=np.int64(5), stop_token_ids=[3, 4], stop="END", seed=2**64 - 1)
    assert isinstance(q.temperature, float) and q.temperature == 1.0
    assert type(q.top_k) is int and q.top_k == 5
    assert q.stop_token_ids == (3, 4)
    assert q.stop == ("END",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=7).stop_token_ids == (7,)
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(top_p=1).top_p == 1.0

    with pytest.raises(dataclasses.FrozenInstanceError):
        q.top_k = 3  # type: ignore[misc]
    # Normalised values make equal requests compare (and hash) equal.
    assert SamplingParams(stop_token_ids=[1, 2]) == SamplingParams(stop_token_ids=(1, 2))
    assert hash(SamplingParams(stop="x")) == hash(SamplingParams(stop=("x",)))


def test_greedy_constructor():
    g = SamplingParams.greedy(max_new_tokens=5, top_k=3)
    assert g.temperature == 0.0 and g.is_greedy and g.max_new_tokens == 5 and g.top_k == 3
    assert not SamplingParams().is_greedy


def test_stack_params_pads_with_greedy_rows():
    t, k, p = stack_params([SamplingParams(temperature=0.7, top_k=4, top_p=0.9), SamplingParams.greedy()], rows=4)
    np.testing.assert_allclose(t, [0.7, 0.0, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(k, [4, 0, 0, 0])
    np.testing.assert_allclose(p, [0.9, 1.0, 1.0, 1.0], rtol=1e-6)
    assert (t.dtype, k.dtype, p.dtype) == (np.float32, np.int32, np.float32)
    with pytest.raises(ValueError):
        stack_params([SamplingParams()] * 3, rows=2)


# --------------------------------------------------------------------------------------------------------
# Seeds and keys
# --------------------------------------------------------------------------------------------------------


def test_request_seed():
    assert request_seed(SamplingParams(seed=42), 7, engine_seed=3) == 42
    unseeded = SamplingParams()
    a = request_seed(unseeded, 7, engine_seed=3)
    assert a == request_seed(unseeded, 7, engine_seed=3)
    assert 0 <= a < 2**64
    assert len({request_seed(unseeded, i, engine_seed=3) for i in range(1000)}) == 1000
    assert a != request_seed(unseeded, 7, engine_seed=4)


def test_seed_words_round_trip_full_64_bits():
    words = seeds_to_words([0, 1, 2**32, 2**64 - 1])
    assert words.dtype == np.uint32 and words.shape == (4, 2)
    np.testing.assert_array_equal(words, [[0, 0], [0, 1], [1, 0], [2**32 - 1, 2**32 - 1]])
    # Seeds differing only in the high word must give different keys.
    k = jax.random.key_data(make_keys([5, 5 + 2**40], [0, 0]))
    assert not np.array_equal(np.asarray(k[0]), np.asarray(k[1]))


def test_keys_from_words_is_jittable_and_matches_make_keys():
    seeds, steps = [3, 99, 2**50], [0, 4, 17]
    jitted = jax.jit(keys_from_words)(seeds_to_words(seeds), np.asarray(steps, np.int32))
    np.testing.assert_array_equal(jax.random.key_data(jitted), jax.random.key_data(make_keys(seeds, steps)))


# --------------------------------------------------------------------------------------------------------
# sample(): greedy and deterministic equivalences
# --------------------------------------------------------------------------------------------------------


# Most deterministic tests share one (R, V) so the jitted sampler compiles once for all of them.
R, V = 32, 64


def _random_logits(rows: int = R, vocab: int = V, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(scale=3.0, size=(rows, vocab)).astype(np.float32)


def test_greedy_rows_are_argmax_with_lowest_index_ties():
    logits = _random_logits()
    logits[2, [5, 17, 30]] = 50.0  # three-way tie for the max
    tokens, _ = _run(logits, 0.0, 0, 1.0, seeds=np.arange(R))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    assert tokens[2] == 5


def test_greedy_ignores_top_k_and_top_p():
    logits = _random_logits(seed=1)
    # Filters that a sampled row would apply (top_k up to 32, top_p down to 0.01) must not matter.
    tokens, _ = _run(logits, 0.0, np.arange(1, R + 1), np.linspace(0.01, 1.0, R), seeds=np.arange(R))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_mixed_batch_greedy_and_sampled_rows():
    logits = _random_logits(seed=2)
    greedy = np.arange(R) % 2 == 0
    temperature = np.where(greedy, 0.0, 5.0).astype(np.float32)  # hot: sampled rows rarely hit the argmax
    tokens, _ = _run(logits, temperature, 0, 1.0, seeds=np.arange(R))
    argmax = logits.argmax(-1)
    np.testing.assert_array_equal(tokens[greedy], argmax[greedy])
    assert (tokens[~greedy] != argmax[~greedy]).sum() >= 8
    assert tokens.min() >= 0 and tokens.max() < V


@pytest.mark.parametrize("temperature", [0.3, 1.0, 4.0])
def test_top_k_one_is_greedy(temperature):
    logits = _random_logits(seed=3)
    tokens, _ = _run(logits, temperature, 1, 1.0, seeds=np.arange(R))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 4.0])
def test_tiny_top_p_is_greedy(temperature):
    logits = _random_logits(seed=4)
    tokens, _ = _run(logits, temperature, 0, 1e-6, seeds=np.arange(R))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_disabled_filters_do_not_change_draws():
    """top_k in {0, -1, >= V} and top_p == 1 are no-ops: the same keys give exactly the same tokens."""
    logits = _random_logits(seed=5)
    seeds = np.arange(R) + 100
    base, _ = _run(logits, 1.3, 0, 1.0, seeds)
    for top_k in (-1, V, V + 7):
        np.testing.assert_array_equal(_run(logits, 1.3, top_k, 1.0, seeds)[0], base)
    # A different row turning a filter on must not perturb the rows that do not use it.
    top_k = np.zeros(R, np.int32)
    top_k[0] = 2
    tokens, _ = _run(logits, 1.3, top_k, 1.0, seeds)
    np.testing.assert_array_equal(tokens[1:], base[1:])
    assert tokens[0] in np.argsort(-logits[0])[:2]


def test_sampler_without_filters_matches_when_no_row_uses_them():
    """The engine runs ``filters=False`` for steps whose rows use neither top-k nor top-p; it must draw exactly
    what the full sampler draws for such rows (greedy and plain temperature sampling)."""
    logits = _random_logits(seed=8)
    temperature = np.where(np.arange(R) % 2 == 0, 0.0, 0.7).astype(np.float32)
    args = (logits, temperature, np.zeros(R, np.int32), np.ones(R, np.float32), make_keys(np.arange(R) + 7, np.zeros(R)))
    full = jax.jit(lambda *a: sample(*a, filters=True))(*args)
    plain = jax.jit(lambda *a: sample(*a, filters=False))(*args)
    np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(full[0]))
    np.testing.assert_array_equal(np.asarray(plain[1]), np.asarray(full[1]))
    # The variant without filters has no branch on device data (a cond would sync the host every step).
    assert "cond" not in jax.make_jaxpr(lambda *a: sample(*a, filters=False))(*args).pretty_print()


def test_sampler_without_logprobs_draws_the_same_tokens_and_skips_the_normaliser():
    """``logprobs=False`` (steps where no row asks for log-probabilities) draws exactly the full sampler's tokens,
    returns zeros for the log-probabilities, and leaves out the log-sum-exp (no exponential anywhere)."""
    logits = _random_logits(seed=9)
    temperature = np.where(np.arange(R) % 2 == 0, 0.0, 0.8).astype(np.float32)
    keys = make_keys(np.arange(R) + 3, np.zeros(R))
    args = (logits, temperature, np.zeros(R, np.int32), np.ones(R, np.float32), keys)
    full = jax.jit(lambda *a: sample(*a, filters=False))(*args)
    plain = jax.jit(lambda *a: sample(*a, filters=False, logprobs=False))(*args)
    np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(full[0]))
    np.testing.assert_array_equal(np.asarray(plain[1]), 0.0)
    assert np.all(np.asarray(full[1]) < 0)

    def has_exp(**kw):  # anywhere in the program, nested jaxprs included
        text = jax.make_jaxpr(lambda *a: sample(*a, filters=False, **kw))(*args).pretty_print()
        return re.search(r"\bexp\b", text) is not None

    assert has_exp() and not has_exp(logprobs=False)


def test_one_argmax_draws_what_separate_greedy_and_noised_argmaxes_drew():
    """The sampler's single argmax (raw logits on greedy rows, noised scaled logits on the others) gives, row by
    row, the tokens of the two argmaxes and the select it replaced, for greedy, hot, filtered, tied, NaN and -inf
    rows; ``sample`` with keys equals ``sample_words`` with their words."""
    logits = _random_logits(seed=11)
    logits[0, [3, 9]] = 40.0  # a greedy row with a tie
    logits[1, [4, 8]] = 40.0  # a sampled row with a tie
    logits[3, 5] = np.nan
    logits[6] = -np.inf
    temperature = np.where(np.arange(R) % 3 == 0, 0.0, 1.3).astype(np.float32)
    top_k = np.where(np.arange(R) % 4 == 1, 5, 0).astype(np.int32)
    top_p = np.where(np.arange(R) % 5 == 2, 0.7, 1.0).astype(np.float32)
    keys = make_keys(np.arange(R) * 7 + 1, np.arange(R))
    words = jax.jit(draw_words)(keys)
    assert words.shape == (R, 2) and words.dtype == np.uint32

    def separate(logits, temperature, top_k, top_p, words):  # the formula before the single argmax
        greedy = temperature <= GREEDY_TEMPERATURE
        scaled = logits / jax.numpy.where(greedy, 1.0, temperature)[:, None]
        use_k, use_p = ~greedy & (top_k > 0) & (top_k < V), ~greedy & (top_p < 1.0)
        scaled = jax.numpy.where(_top_k_mask(scaled, jax.numpy.where(use_k, top_k, 0)), scaled, -np.inf)
        scaled = jax.numpy.where(_top_p_mask(scaled, jax.numpy.where(use_p, top_p, 1.0)), scaled, -np.inf)
        noised = jax.numpy.argmax(scaled + _gumbel_noise(words, logits.shape), axis=-1)
        return jax.numpy.where(greedy, jax.numpy.argmax(logits, axis=-1), noised)

    expected = np.asarray(jax.jit(separate)(logits, temperature, top_k, top_p, words))
    got = jax.jit(sample_words)(logits, temperature, top_k, top_p, words)
    np.testing.assert_array_equal(np.asarray(got[0]), expected)
    assert expected[0] == 3 and expected[3] == 5 and expected[6] == 0
    assert (expected[1:][temperature[1:] > 0] != logits[1:][temperature[1:] > 0].argmax(-1)).any()
    via_keys = _sample(logits, temperature, top_k, top_p, keys)
    np.testing.assert_array_equal(np.asarray(via_keys[0]), expected)
    np.testing.assert_array_equal(np.asarray(via_keys[1]), np.asarray(got[1]))


def test_one_argmax_serves_greedy_and_sampled_rows():
    """One pass of argmax over the logits per step (each pass is more kernels in every decode step)."""
    args = (_random_logits(seed=12), np.zeros(R, np.float32), np.zeros(R, np.int32), np.ones(R, np.float32),
            make_keys(np.arange(R), np.zeros(R)))
    text = jax.make_jaxpr(lambda *a: sample(*a, filters=False, logprobs=False))(*args).pretty_print()
    assert len(re.findall(r"\bargmax\b", text)) == 1


def test_bf16_logits_accepted():
    logits = _random_logits(seed=6)
    tokens, logprobs = _run(jax.numpy.asarray(logits, jax.numpy.bfloat16), 0.0, 0, 1.0, np.arange(R))
    rounded = np.asarray(jax.numpy.asarray(logits, jax.numpy.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(tokens, rounded.argmax(-1))
    assert logprobs.dtype == np.float32


def test_one_compile_for_all_parameter_values():
    traces = []

    def counted(*args):
        traces.append(1)
        return sample(*args)

    f = jax.jit(counted)
    logits = _random_logits(seed=7)
    for t, k, p in [(0.0, 0, 1.0), (0.7, 3, 0.9), (1.5, -1, 0.5), (1.0, 0, 1.0)]:
        f(logits, np.full(R, t, np.float32), np.full(R, k, np.int32), np.full(R, p, np.float32),
          make_keys(np.arange(R), np.full(R, 3)))
    assert len(traces) == 1


# --------------------------------------------------------------------------------------------------------
# sample(): distributions
# --------------------------------------------------------------------------------------------------------


def _expected(temperature: float, top_k: int, top_p: float, logits: np.ndarray = LOGITS6) -> np.ndarray:
    """Reference distribution by the textbook sort-based definition, in float64."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(len(x), bool)
    keep[order[: top_k if top_k > 0 else len(x)]] = True
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    sorted_p = p[order]
    # Smallest prefix whose mass reaches top_p (mass *before* a token < top_p means the token is needed).
    needed = (np.cumsum(sorted_p) - sorted_p) < top_p
    keep_p = np.zeros(len(x), bool)
    keep_p[order[needed]] = True
    p = np.where(keep_p, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (2.0, 0, 1.0),
        (1.0, 3, 1.0),
        (0.7, 3, 1.0),
        (1.0, 0, 0.8),
        (1.5, 0, 0.8),
        (1.0, 4, 0.7),
    ],
)
def test_empirical_distribution_matches(temperature, top_k, top_p):
    logits = np.broadcast_to(LOGITS6, (N_DRAWS, 6))
    tokens, _ = _run(logits, temperature, top_k, top_p, seeds=np.arange(N_DRAWS) + 12345)
    expected = _expected(temperature, top_k, top_p)
    freq = _frequencies(tokens, 6)
    assert np.abs(freq - expected).max() < TOL, (freq, expected)
    # Filtered-out tokens must never appear at all.
    assert freq[expected == 0].sum() == 0


@pytest.mark.parametrize("top_k", [0, 9])
def test_empirical_distribution_matches_over_a_larger_vocab(top_k):
    """Mass spread over entries across a vocabulary of 1003, first and last entries included, comes out in
    proportion, and entries a filter removed or whose probability underflows to 0 never do."""
    vocab = 1003
    logits = np.full(vocab, -200.0, np.float32)  # exp(-200 - max) underflows to 0 in float32
    heavy = [0, 1, 31, 32, 33, 500, 511, 512, 990, 1001, 1002]
    logits[heavy] = np.linspace(1.0, 2.5, len(heavy))
    draws = 8000
    tokens, _ = _run(np.broadcast_to(logits, (draws, vocab)), 1.0, top_k, 1.0, seeds=np.arange(draws) + 777)
    expected = _expected(1.0, top_k, 1.0, logits)
    freq = _frequencies(tokens, vocab)
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(expected))
    assert np.abs(freq - expected).max() < 0.03, (freq[heavy], expected[heavy])  # max std 0.0051


def test_reference_filters_are_not_trivial():
    """Guard for the test above: the chosen settings really do cut tokens and change the distribution."""
    full = _expected(1.0, 0, 1.0)
    assert (_expected(1.0, 3, 1.0) == 0).sum() == 3
    assert 0 < (_expected(1.0, 0, 0.8) == 0).sum() < 5
    assert np.abs(_expected(0.7, 0, 1.0) - full).max() > 0.05


def test_top_k_keeps_ties_at_the_boundary():
    logits = np.broadcast_to(np.array([2.0, 1.0, 1.0, 0.0, -1.0, -2.0], np.float32), (N_DRAWS, 6))
    tokens, _ = _run(logits, 1.0, 2, 1.0, seeds=np.arange(N_DRAWS))
    e = np.exp([2.0, 1.0, 1.0])
    expected = np.concatenate([e / e.sum(), np.zeros(3)])
    freq = _frequencies(tokens, 6)
    assert np.abs(freq - expected).max() < TOL
    assert freq[3:].sum() == 0


def test_top_p_with_masked_vocab_entries():
    """-inf logits (padded vocabulary) are never drawn and do not upset the nucleus search."""
    row = np.array([1.0, -np.inf, 0.5, -np.inf, 0.0, -3.0], np.float32)
    tokens, _ = _run(np.broadcast_to(row, (N_DRAWS, 6)), 1.0, 0, 0.9, seeds=np.arange(N_DRAWS))
    finite = np.where(np.isfinite(row), row, -1e30)
    freq = _frequencies(tokens, 6)
    assert freq[[1, 3]].sum() == 0
    assert np.abs(freq - _expected(1.0, 0, 0.9, finite)).max() < TOL


# --------------------------------------------------------------------------------------------------------
# sample(): seeds
# --------------------------------------------------------------------------------------------------------


def test_seeded_draw_is_independent_of_batch_position_and_composition():
    vocab = V
    rng = np.random.default_rng(8)
    target = rng.normal(scale=0.5, size=vocab).astype(np.float32)  # flat: a wrong key changes the token
    seed, step = 2**40 + 17, 9

    def draw(rows: int, position: int, temperature: float, top_k: int, top_p: float) -> int:
        logits = rng.normal(scale=2.0, size=(rows, vocab)).astype(np.float32)
        logits[position] = target
        seeds = rng.integers(0, 2**31, size=rows)
        seeds[position] = seed
        steps = rng.integers(0, 50, size=rows)
        steps[position] = step
        t = rng.uniform(0.0, 2.0, size=rows).astype(np.float32)
        k = rng.integers(-1, 20, size=rows).astype(np.int32)
        p = rng.uniform(0.3, 1.0, size=rows).astype(np.float32)
        t[position], k[position], p[position] = temperature, top_k, top_p
        return int(_run(logits, t, k, p, seeds, steps)[0][position])

    for params in [(1.0, 0, 1.0), (0.8, 50, 0.95)]:
        alone = draw(1, 0, *params)
        assert all(draw(rows, pos, *params) == alone for rows, pos in [(R, 0), (R, 13), (R, R - 1)])


def test_steps_and_seeds_give_independent_draws():
    seed = 2**40 + 17
    # The same request at many steps: the draws follow the distribution, so each step got a fresh key.
    steps = np.arange(N_DRAWS)
    logits = np.broadcast_to(LOGITS6, (N_DRAWS, 6))
    tokens, _ = _run(logits, 1.0, 0, 1.0, np.full(N_DRAWS, seed), steps)
    assert np.abs(_frequencies(tokens, 6) - _softmax(LOGITS6)).max() < TOL
    # A different seed gives a different sequence (agreement ~ sum p^2 ~ 0.3 for independent draws).
    other, _ = _run(logits, 1.0, 0, 1.0, np.full(N_DRAWS, seed + 1), steps)
    assert (other == tokens).mean() < 0.4


# --------------------------------------------------------------------------------------------------------
# sample(): logprobs
# --------------------------------------------------------------------------------------------------------


def test_logprobs_are_raw_model_log_softmax():
    logits = _random_logits(seed=9)
    temperature = np.array([0.0, 0.5, 1.0, 2.0] * (R // 4), np.float32)
    top_k = np.array([0, 0, 5, 0, 3, 0, 0, 1] * (R // 8), np.int32)
    top_p = np.array([1.0, 0.5, 1.0, 0.9] * (R // 4), np.float32)
    tokens, logprobs = _run(logits, temperature, top_k, top_p, seeds=np.arange(R))
    expected = _log_softmax(logits)[np.arange(R), tokens]
    assert len(set(tokens.tolist())) > 8  # the rows really did draw different tokens
    np.testing.assert_allclose(logprobs, expected, rtol=1e-5, atol=1e-5)
    assert logprobs.dtype == np.float32


# --------------------------------------------------------------------------------------------------------
# check_stop / StopChecker
# --------------------------------------------------------------------------------------------------------

EOS = (2, 7)


def test_continue_when_nothing_applies():
    assert check_stop(SamplingParams(max_new_tokens=5), [10, 11], "hello", EOS) == (None, None)


def test_eos_stops_unless_ignored():
    assert check_stop(SamplingParams(), [10, 7], "x", EOS) == ("stop", None)
    assert check_stop(SamplingParams(), [10, 2], None, EOS) == ("stop", None)
    assert check_stop(SamplingParams(ignore_eos=True), [10, 7], "x", EOS) == (None, None)
    # EOS earlier in the sequence is not the latest token: not a new stop.
    assert check_stop(SamplingParams(ignore_eos=True), [7, 10], "x", EOS) == (None, None)


def test_stop_token_ids_stop_even_with_ignore_eos():
    p = SamplingParams(stop_token_ids=[42], ignore_eos=True)
    assert check_stop(p, [1, 42], "x", EOS) == ("stop", None)
    assert check_stop(p, [42, 1], "x", EOS) == (None, None)


def test_length():
    p = SamplingParams(max_new_tokens=3)
    assert check_stop(p, [5, 6], "ab", EOS) == (None, None)
    assert check_stop(p, [5, 6, 8], "abc", EOS) == ("length", None)


def test_stop_beats_length_on_the_same_token():
    p = SamplingParams(max_new_tokens=2, stop_token_ids=[9], stop="END")
    assert check_stop(p, [5, 2], "ab", EOS) == ("stop", None)
    assert check_stop(p, [5, 9], "ab", EOS) == ("stop", None)
    assert check_stop(p, [5, 6], "abEND", EOS) == ("stop", 2)


def test_stop_string_truncation_index_is_earliest_match():
    p = SamplingParams(stop=["world", "lo w", "zzz"])
    text = "hello world"
    assert check_stop(p, [1, 1, 1], text, EOS) == ("stop", 3)
    assert text[:3] == "hel"
    assert check_stop(SamplingParams(stop=["o"]), [1], text, EOS) == ("stop", 4)
    assert check_stop(SamplingParams(stop=["xyz"]), [1], text, EOS) == (None, None)


def test_stop_string_spanning_decode_steps_with_search_from():
    p = SamplingParams(stop=["STOP"], max_new_tokens=100)
    step1 = "abc ST"
    assert check_stop(p, [1], step1, EOS, search_from=0) == (None, None)
    step2 = step1 + "OP and more"
    # Only the new tail is searched, but the overlap catches the string that straddles the boundary.
    assert check_stop(p, [1, 1], step2, EOS, search_from=len(step1)) == ("stop", 4)


def test_search_from_skips_already_checked_text():
    # A match that ends before search_from was already reported (or deliberately skipped) by the caller.
    p = SamplingParams(stop=["ab"])
    assert check_stop(p, [1], "ab......", EOS, search_from=6) == (None, None)
    assert check_stop(p, [1], "ab......ab", EOS, search_from=8) == ("stop", 8)
    # One character of overlap for a two-character string: "a|b" across the boundary.
    assert check_stop(p, [1], "xxa" + "b", EOS, search_from=3) == ("stop", 2)


def test_stop_checker_streams_text():
    checker = StopChecker(SamplingParams(stop=["</s>", "\n\n"], max_new_tokens=50), eos_token_ids=EOS)
    pieces = ["Hi", " there", "<", "/", "s", ">tail"]
    text, ids, result = "", [], (None, None)
    for piece in pieces:
        text += piece
        ids.append(1)
        result = checker(ids, text)
        if result[0] is not None:
            break
    assert result == ("stop", len("Hi there"))
    assert len(ids) == len(pieces)  # found on the step that completed the string, not before

    checker.reset()
    assert checker([1], "Hi there</s>") == ("stop", 8)


def test_threshold_filters_match_sort_reference_on_a_large_vocab():
    """The sort-free threshold search keeps exactly the sort-based top-k / nucleus sets (no ties here)."""
    rows, vocab = 8, 4096
    logits = np.random.default_rng(10).normal(scale=2.0, size=(rows, vocab)).astype(np.float32)
    top_k = np.array([1, 2, 17, 100, 1000, 4095, 4096, 5000], np.int32)
    top_p = np.array([1e-6, 0.1, 0.5, 0.8, 0.9, 0.95, 0.999, 1.0], np.float32)
    k_mask = np.asarray(jax.jit(_top_k_mask)(logits, top_k))
    p_mask = np.asarray(jax.jit(_top_p_mask)(logits, top_p))
    for r in range(rows):
        order = np.argsort(-logits[r])
        np.testing.assert_array_equal(np.flatnonzero(k_mask[r]), np.sort(order[: top_k[r]]))
        expected_p = _expected(1.0, 0, float(top_p[r]), logits[r]) > 0
        np.testing.assert_array_equal(p_mask[r], expected_p, err_msg=f"row {r}, top_p={top_p[r]}")
