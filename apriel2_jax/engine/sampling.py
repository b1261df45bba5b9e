"""Token sampling for the serving engine: request parameters, stop conditions and the jitted sampler.

The module has two halves that meet only through plain arrays:

* Host side (no JAX): :class:`SamplingParams` (validated once, at request admission, so a bad request fails
  with a message naming the field instead of producing NaNs deep inside a compiled step), :func:`check_stop` /
  :class:`StopChecker` (finish conditions, evaluated after every decode step), :func:`request_seed` and
  :func:`stack_params` (turn a batch of requests into the per-row arrays the device needs).
* Device side (pure, jittable, fixed shapes): :func:`sample` (or :func:`sample_words` with the keys' words from
  :func:`draw_words`) and :func:`keys_from_words` / :func:`make_keys`.
  Every per-request knob is a per-row *array*, never a Python value, so a batch mixing greedy and sampled
  requests with different temperatures, top-k and top-p runs through one executable per ``(R, V)`` shape.

Design choices of :func:`sample` (see its docstring for details):

* **No sort.** Top-k and top-p are both "keep every entry at or above a per-row threshold"; the threshold is
  found exactly by a 32-step bitwise search over the order-preserving integer image of the float values (a
  radix select). That costs ~63 fused compare-and-reduce passes over ``[R, V]`` instead of an
  ``O(V log^2 V)`` bitonic sort, needs no static cap on ``k`` and makes top-p exact over the whole vocabulary.
  A step whose rows use neither filter runs a variant without them (``filters=False``, chosen on the host):
  a run-time ``lax.cond`` would cost a device-to-host sync inside every step. Likewise a step where no row
  asks for log-probabilities runs without the log-sum-exp over the vocabulary (``logprobs=False``).
* **Ties at a threshold are kept.** Top-k keeps every token whose logit equals the k-th largest, and top-p
  keeps every token whose probability equals the smallest kept one, so the result never depends on the
  vocabulary order of equal values (it may keep slightly more than ``k`` tokens / more than the minimal mass).
* **Keys** are new-style typed PRNG key arrays of shape ``[R]`` (threefry2x32). A row's key is derived from the
  request's seed and its generation step only, so a seeded request draws the same tokens whatever batch it
  runs in and at whatever row.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "SamplingError",
    "SamplingParams",
    "check_stop",
    "StopChecker",
    "request_seed",
    "stack_params",
    "seeds_to_words",
    "draw_words",
    "keys_from_words",
    "make_keys",
    "sample",
    "sample_words",
    "GREEDY_TEMPERATURE",
    "MAX_SEED",
]

# Temperatures at or below this are treated as greedy on the device: dividing logits by a smaller number can
# overflow float32 to inf (and inf - inf = NaN in the softmax), and the distribution is already a point mass.
GREEDY_TEMPERATURE = 1e-5

# Seeds are used as the 64 bits of a threefry key; larger integers would have to be hashed, which would make
# two distinct user seeds collide silently, so they are rejected instead.
MAX_SEED = 2**64 - 1

_MASK64 = 2**64 - 1


# --------------------------------------------------------------------------------------------------------
# Host side: parameters
# --------------------------------------------------------------------------------------------------------


class SamplingError(ValueError):
    """A sampling parameter is out of range. ``field`` names it and ``value`` is what was given."""

    def __init__(self, field: str, value: Any, expected: str):
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"SamplingParams.{field}: got {value!r}, expected {expected}")


def _is_int(x: Any) -> bool:
    # bool is an int subclass, but `top_k=True` is always a mistake.
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings.

    ``temperature == 0`` is greedy (and then ``top_k`` / ``top_p`` / ``seed`` are irrelevant). ``top_k`` of 0
    or -1 disables top-k. ``seed=None`` lets the engine derive a seed from its own seed and the request's
    sequence number (:func:`request_seed`), so runs of the same engine are still reproducible.
    ``stop_token_ids`` end generation *including* the token; ``stop`` strings end it and are cut from the
    output text together with everything after them. ``logprobs`` asks for the chosen tokens'
    log-probabilities under the unmodified model distribution.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise SamplingError("temperature", t, "a finite number >= 0 (0 means greedy)")
        object.__setattr__(self, "temperature", float(t))

        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingError("top_k", self.top_k, "an integer >= -1 (0 or -1 disables top-k)")
        object.__setattr__(self, "top_k", int(self.top_k))

        p = self.top_p
        if not _is_real(p) or not math.isfinite(p) or not 0 < p <= 1:
            raise SamplingError("top_p", p, "a number in (0, 1] (1 disables top-p)")
        object.__setattr__(self, "top_p", float(p))

        if self.seed is not None:
            if not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
                raise SamplingError("seed", self.seed, f"an integer from 0 to 2**{MAX_SEED.bit_length()} - 1, or unset")
            object.__setattr__(self, "seed", int(self.seed))

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise SamplingError("max_new_tokens", self.max_new_tokens, "an integer >= 1")
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))

        object.__setattr__(self, "stop_token_ids", self._token_ids(self.stop_token_ids))
        object.__setattr__(self, "stop", self._stop_strings(self.stop))

        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise SamplingError(name, getattr(self, name), "a bool")
            object.__setattr__(self, name, bool(getattr(self, name)))

    @staticmethod
    def _token_ids(ids: Any) -> tuple[int, ...]:
        expected = "a sequence of integer token ids >= 0"
        if _is_int(ids):
            ids = (ids,)
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise SamplingError("stop_token_ids", ids, expected)
        ids = tuple(ids)
        if not all(_is_int(i) and i >= 0 for i in ids):
            raise SamplingError("stop_token_ids", ids, expected)
        return tuple(int(i) for i in ids)

    @staticmethod
    def _stop_strings(stop: Any) -> tuple[str, ...]:
        expected = "a non-empty string or a sequence of non-empty strings"
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Iterable):
            raise SamplingError("stop", stop, expected)
        stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise SamplingError("stop", stop, expected)
        return stop

    @classmethod
    def greedy(cls, **kw: Any) -> SamplingParams:
        """Deterministic argmax decoding; other fields as given."""
        return cls(temperature=0.0, **kw)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE

    @property
    def uses_filters(self) -> bool:
        """Whether top-k or top-p changes this request's draws (the sampler variant that has them is needed)."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0)


def stack_params(params: Sequence[SamplingParams], rows: int | None = None) -> tuple[np.ndarray, ...]:
    """Per-row ``(temperature f32[R], top_k i32[R], top_p f32[R])`` for :func:`sample`.

    Rows beyond ``len(params)`` (padding up to a fixed batch size ``rows``) are greedy: it is the cheapest
    setting, and a padding row never turns on a filter pass for the whole batch.
    """
    n = len(params) if rows is None else rows
    if n < len(params):
        raise ValueError(f"stack_params: {len(params)} requests do not fit in {n} rows")
    temperature = np.zeros(n, np.float32)
    top_k = np.zeros(n, np.int32)
    top_p = np.ones(n, np.float32)
    for i, p in enumerate(params):
        temperature[i] = p.temperature
        # Values beyond int32 mean "no limit" anyway; sample() clamps k to V.
        top_k[i] = min(p.top_k, np.iinfo(np.int32).max)
        top_p[i] = p.top_p
    return temperature, top_k, top_p


# --------------------------------------------------------------------------------------------------------
# Host side: stop conditions
# --------------------------------------------------------------------------------------------------------


def check_stop(
    params: SamplingParams,
    generated_ids: Sequence[int],
    text: str | None = None,
    eos_token_ids: Sequence[int] = (),
    *,
    search_from: int = 0,
) -> tuple[str | None, int | None]:
    """Decide whether a request is finished after its latest token.

    Returns ``(finish_reason, truncate_at)``: ``finish_reason`` is ``None`` (keep going), ``"stop"`` or
    ``"length"``; ``truncate_at`` is the index in ``text`` where the earliest stop string begins (the output
    text should be ``text[:truncate_at]``), or ``None`` when no stop string matched. A stop/EOS token stays in
    ``generated_ids``; whether its text is shown is the caller's decision.

    A finished stop condition beats ``"length"`` when both happen on the same token, since the model did
    finish on its own.

    ``search_from`` is the length of ``text`` already checked by a previous call: only matches that *end*
    past it are looked for, so the cost per step is proportional to the new text, not the whole output. A
    stop string straddling the boundary is still found, because each string's search starts ``len(s) - 1``
    characters before ``search_from``.
    """
    truncate_at: int | None = None
    if params.stop and text is not None:
        for s in params.stop:
            i = text.find(s, max(0, search_from - len(s) + 1))
            if i >= 0 and (truncate_at is None or i < truncate_at):
                truncate_at = i
    if truncate_at is not None:
        return "stop", truncate_at

    if generated_ids:
        return _token_stop(params, generated_ids[-1], len(generated_ids), eos_token_ids), None
    return ("length" if params.max_new_tokens <= 0 else None), None


def _token_stop(params: SamplingParams, last: int, generated: int, eos_token_ids: Sequence[int]) -> str | None:
    """The finish reason that ids alone give after ``generated`` tokens ending in ``last`` (stop strings aside)."""
    if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
        return "stop"
    if generated >= params.max_new_tokens:
        return "length"
    return None


class StopChecker:
    """:func:`check_stop` with the ``search_from`` bookkeeping done for the caller.

    Feed it the full generated ids and the full decoded text after every step. It assumes the text only
    grows by appending; if detokenization rewrites earlier characters, call :meth:`reset`.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int] = ()):
        self.params = params
        self.eos_token_ids = tuple(eos_token_ids)
        self._checked = 0

    def reset(self) -> None:
        self._checked = 0

    @property
    def needs_text(self) -> bool:
        """Whether stop strings are checked (on the text, token by token, where they complete)."""
        return bool(self.params.stop)

    def scan(self, new_ids: Sequence[int], generated: int, room: int) -> tuple[int, str | None]:
        """Stop-string-free check of several new ids at once: ``(how many of them to keep, finish reason)``.
        ``generated`` counts the ids before them, ``room`` how many more the sequence may hold ("length" once
        it is reached). The same decision :meth:`__call__` makes token by token."""
        for j, token in enumerate(new_ids):
            reason = _token_stop(self.params, token, generated + j + 1, self.eos_token_ids)
            if reason is None and j + 1 >= room:
                reason = "length"
            if reason is not None:
                return j + 1, reason
        return len(new_ids), None

    def __call__(self, generated_ids: Sequence[int], text: str | None = None) -> tuple[str | None, int | None]:
        result = check_stop(
            self.params, generated_ids, text, self.eos_token_ids, search_from=self._checked
        )
        if text is not None:
            self._checked = len(text)
        return result


# --------------------------------------------------------------------------------------------------------
# Host side: seeds
# --------------------------------------------------------------------------------------------------------


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: a bijection on 64-bit ints that spreads nearby inputs far apart."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_seed(params: SamplingParams, request_index: int, engine_seed: int = 0) -> int:
    """The 64-bit seed a request samples with.

    An explicit ``params.seed`` is used as is, so the same request reproduces across engines and batches.
    Unseeded requests get a seed hashed from the engine seed and the request's sequence number: a fixed engine
    seed makes a whole run reproducible, and consecutive requests still get unrelated streams.
    """
    if params.seed is not None:
        return params.seed
    return _mix64(_mix64(engine_seed) ^ _mix64(request_index + 0x9E3779B97F4A7C15))


def seeds_to_words(seeds: Sequence[int] | np.ndarray) -> np.ndarray:
    """64-bit seeds -> ``uint32[R, 2]`` (high word, low word): threefry's raw key data for that seed.

    Done on the host because JAX without x64 cannot hold a 64-bit seed in one array element.
    """
    seeds = [int(s) for s in np.asarray(seeds, dtype=object).reshape(-1)]
    for s in seeds:
        if not 0 <= s <= MAX_SEED:
            raise ValueError(f"seed {s} outside [0, {MAX_SEED}]")
    return np.array([[s >> 32, s & 0xFFFFFFFF] for s in seeds], dtype=np.uint32).reshape(len(seeds), 2)


# --------------------------------------------------------------------------------------------------------
# Device side
# --------------------------------------------------------------------------------------------------------


def keys_from_words(seed_words: jax.Array, steps: jax.Array) -> jax.Array:
    """Typed threefry keys ``[R]`` for one sampling step. Jittable.

    ``seed_words`` is ``uint32[R, 2]`` from :func:`seeds_to_words`; ``steps`` is ``int[R]``, the number of
    tokens the request has generated so far. The key depends only on (seed, step), never on the row or the
    batch, which is what makes seeded requests batch-invariant; folding in the step gives each position of
    the generation a fresh draw.
    """
    keys = jax.random.wrap_key_data(jnp.asarray(seed_words, jnp.uint32), impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, jnp.asarray(steps, jnp.uint32))


_keys_from_words_jit = jax.jit(keys_from_words)


def make_keys(seeds: Sequence[int] | np.ndarray, steps: Sequence[int] | np.ndarray) -> jax.Array:
    """Host convenience: :func:`keys_from_words` from Python/NumPy seeds (any 64-bit value) and steps."""
    return _keys_from_words_jit(seeds_to_words(seeds), np.asarray(steps).astype(np.uint32))


def _mix32(x: jax.Array) -> jax.Array:
    """A bijective 32-bit integer hash with strong avalanche ("lowbias32", C. Wellons' hash-prospector)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def draw_words(keys: jax.Array) -> jax.Array:
    """The two threefry words ``uint32[R, 2]`` of each row's key that seed its Gumbel noise (:func:`sample_words`).
    Jittable; the engine draws a dispatch's words for all its steps at once, ahead of its device loop."""
    return jax.vmap(lambda key: jax.random.bits(key, (2,), jnp.uint32))(keys)


def _gumbel_noise(words: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Standard Gumbel noise ``[R, V]`` for the Gumbel-max trick: ``argmax(scaled + G)`` draws from
    ``softmax(scaled)``.

    ``jax.random.categorical`` makes that noise with threefry (20 rounds of add, rotate and xor per pair of
    words): at a 152K vocabulary its noised argmax took 38 us per decode step at 32 rows and 280 us at 256 on an
    H200, more than the rest of sampling together. Here threefry makes two words per row (from the row's key, so
    a draw still depends only on its seed and step), and each entry's uniform number is a keyed hash of its
    index (two rounds of a 32-bit mixer), in the same fused reduction as the argmax. Uniforms lie in (0, 1) at
    24-bit resolution."""
    index = lax.broadcasted_iota(jnp.uint32, shape, 1)
    bits = _mix32(_mix32(index ^ words[:, :1]) ^ words[:, 1:])
    uniform = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))
    return -jnp.log(-jnp.log(uniform))


def _ordered_bits(x: jax.Array) -> jax.Array:
    """float32 -> uint32 such that ``a < b`` iff ``bits(a) < bits(b)`` (NaN excluded).

    Positive floats already compare like their bit patterns; negative ones compare in reverse, so flip all
    their bits, and set the sign bit of positives to put them above every negative.
    """
    b = lax.bitcast_convert_type(x, jnp.uint32)
    negative = (b >> 31) == 1
    return jnp.where(negative, ~b, b | jnp.uint32(0x80000000))


def _largest_threshold(ordered: jax.Array, satisfied: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Per row, the largest ``t`` (uint32) with ``satisfied(ordered >= t)`` true, by bitwise search.

    ``satisfied`` maps a keep-mask ``[R, V]`` to ``bool[R]`` and must be monotone (true for a mask implies
    true for any superset). Bits are decided from the most significant down, so 32 passes give the exact
    answer; t = 0 (keep everything) is the fallback when nothing larger qualifies.
    """

    def body(i, t):
        cand = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(satisfied(ordered >= cand[:, None]), cand, t)

    return lax.fori_loop(0, 32, body, jnp.zeros(ordered.shape[:1], jnp.uint32))


def _top_k_mask(scaled: jax.Array, top_k: jax.Array) -> jax.Array:
    """Keep tokens whose logit is >= the k-th largest (so ties with the k-th are all kept)."""
    vocab = scaled.shape[-1]
    k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    ordered = _ordered_bits(scaled)
    t = _largest_threshold(ordered, lambda keep: jnp.sum(keep, axis=-1, dtype=jnp.int32) >= k)
    return ordered >= t[:, None]


def _top_p_mask(scaled: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep tokens whose probability is >= the smallest p such that all tokens at least that likely hold
    ``top_p`` of the mass. The most likely token always qualifies, since the threshold can never exceed it.
    """
    probs = jax.nn.softmax(scaled, axis=-1)
    ordered = _ordered_bits(probs)
    t = _largest_threshold(ordered, lambda keep: jnp.sum(jnp.where(keep, probs, 0.0), axis=-1) >= top_p)
    # top_p >= 1 keeps everything, even when the float sum of all probabilities rounds below 1.
    return (ordered >= t[:, None]) | (top_p >= 1.0)[:, None]


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
    filters: bool = True,
    logprobs: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row. Pure and jittable; one compile per ``(R, V)`` shape, ``filters`` and ``logprobs``.

    Args:
      logits: ``[R, V]``, any float dtype (computed in float32).
      temperature: ``f32[R]``; rows with ``temperature <= GREEDY_TEMPERATURE`` take the argmax of the raw
        logits (lowest index on ties) and ignore ``top_k`` / ``top_p``.
      top_k: ``i32[R]``; ``<= 0`` (or ``>= V``) disables it. Ties with the k-th largest logit are kept.
      top_p: ``f32[R]`` in (0, 1]; 1 disables it. Applied after top-k, on the temperature-scaled and top-k
        renormalised distribution. Ties with the smallest kept probability are kept.
      keys: typed PRNG key array ``[R]`` (:func:`make_keys` / :func:`keys_from_words`). Row ``r``'s draw
        depends only on ``keys[r]`` and ``logits[r]``.
      filters: static. False leaves out the top-k / top-p code; valid only when no row uses either (the
        engine picks the variant per step on the host, so the compiled step has no data-dependent branch).
      logprobs: static. False leaves out the log-sum-exp over the vocabulary (a pass over the logits) and returns
        zeros in its place: the engine's variant for steps where no row asks for log-probabilities.

    Returns:
      ``(tokens i32[R], logprobs f32[R])``; ``logprobs`` is the chosen token's log-probability under the
      unmodified model distribution (``log_softmax(logits)``, no temperature or filtering), so it means the
      same thing whatever sampling settings produced the token.
    """
    return sample_words(logits, temperature, top_k, top_p, draw_words(keys), filters=filters, logprobs=logprobs)


def sample_words(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    words: jax.Array,
    filters: bool = True,
    logprobs: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """:func:`sample` with each row's key given as its two words ``uint32[R, 2]`` (:func:`draw_words`)."""
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    vocab = logits.shape[-1]

    greedy = temperature <= GREEDY_TEMPERATURE
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    use_top_k = ~greedy & (top_k > 0) & (top_k < vocab)
    use_top_p = ~greedy & (top_p < 1.0)

    if filters:
        # The filters are the expensive part (~32 passes over [R, V] each). They run over every row: a row that
        # does not use one keeps everything, so the variant changes speed, never tokens.
        scaled = jnp.where(_top_k_mask(scaled, jnp.where(use_top_k, top_k, 0)), scaled, -jnp.inf)
        scaled = jnp.where(_top_p_mask(scaled, jnp.where(use_top_p, top_p, 1.0)), scaled, -jnp.inf)

    # One argmax serves greedy rows (the raw logits) and sampled ones (the noised, scaled logits): a greedy
    # argmax beside the noised one is another pass over the [R, V] logits and more kernels per decode step.
    noised = scaled + _gumbel_noise(words, logits.shape)
    tokens = jnp.argmax(jnp.where(greedy[:, None], logits, noised), axis=-1).astype(jnp.int32)

    if not logprobs:
        return tokens, jnp.zeros(tokens.shape, jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen - log_z
