"""The jitted engine step: one compiled function per step shape, placement and sampler variant.

A step's host inputs are two arrays, built once per step by :func:`build_inputs`: ``ints [rows, columns]``
(tokens, start position, length, slot, block tables, sampling seeds, stop ids, ...; see :class:`StepLayout`)
and ``floats [rows, 2]`` (temperature, top-p). Two transfers per step, and the parameters and caches are passed
as flat lists of arrays, so a call costs the host microseconds rather than a pytree walk over every module.

A decode step runs up to ``decode_steps`` tokens per row in one dispatch: a device loop feeds each row's
sampled token back, stops a row at one of its stop ids or at its token budget, and ends when every row has
stopped (checked every ``STEPS_PER_STOP_CHECK`` iterations). A stopped row is turned into padding (sink slot,
sink pages), so later iterations never touch its state. Padding rows and tokens touch only the sink page and sink
slot, so a bucket larger than the live requests (or the state slots) never indexes out of bounds.

A decode dispatch can be *chained* onto the previous one before the host has read it: each of its rows continues
a row of the previous dispatch, whose last sampled token it feeds and whose stop it keeps (a row stopped there
runs as padding), both read on the device from the previous dispatch's outputs (``previous``). A dispatch
without stop checks (every row runs the whole loop unless it stops) returns as soon as it is queued, so the
host can queue the next dispatch and then read this one while the device runs them back to back.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ..modules import Apriel2ForCausalLM
from ..modules.paged import PagedBatch
from ..placement import Placement
from ..tensor_parallel import ShardedModel
from .cache_manager import CacheManager
from .sampling import draw_words, keys_from_words, sample_words
from .scheduler import ScheduledStep

# Stop ids checked on the device per row (EOS ids and the request's stop_token_ids); a request with more is
# still stopped correctly by the host, only later than it could be.
DEVICE_STOP_IDS = 4

# Decode iterations between the device loop's checks whether every row has stopped. Each check costs a host
# round trip with the device idle (up to ~30 us per step measured on an H200, against a 0.8 ms step of the 0.5B
# geometry); once every row has stopped, up to this many minus one iterations run as padding.
STEPS_PER_STOP_CHECK = 4


def stop_check_group(decode_steps: int) -> int:
    """Iterations between the device loop's stop checks for dispatches of up to ``decode_steps`` steps: a dispatch
    runs whole groups, so a row that stops mid-group leaves the rest of the group as padding."""
    return math.gcd(decode_steps, STEPS_PER_STOP_CHECK)


def _powers_of_two_upto(limit: int, start: int = 1) -> tuple[int, ...]:
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (limit,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The step shapes (rows, tokens per row) the engine runs; a step is padded up to the smallest that holds it.

    Prefill shapes are the pairs of ``prefill_rows`` x ``prefill_tokens`` whose padded size fits the token
    budget (``max_tokens``), plus one row of any width: a step never pads past the budget it was scheduled
    under, so no shape is compiled that the scheduler cannot produce."""

    decode_rows: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    max_tokens: int | None = None

    @classmethod
    def default(cls, max_num_seqs: int, max_prefill_rows: int, max_chunk: int, max_tokens: int | None = None) -> "Buckets":
        return cls(
            _powers_of_two_upto(max_num_seqs),
            _powers_of_two_upto(max_prefill_rows),
            _powers_of_two_upto(max_chunk, start=min(16, max_chunk)),
            max_tokens,
        )

    def prefill_shapes(self) -> list[tuple[int, int]]:
        shapes = []
        for tokens in self.prefill_tokens:
            for rows in self.prefill_rows:
                if rows == self.prefill_rows[0] or self.max_tokens is None or rows * tokens <= self.max_tokens:
                    shapes.append((rows, tokens))
        return shapes

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, tokens) shape the engine can run."""
        return [(r, 1) for r in self.decode_rows] + self.prefill_shapes()

    def pick(self, kind: str, rows: int, tokens: int) -> tuple[int, int]:
        def smallest(options, n):
            i = bisect.bisect_left(options, n)
            if i == len(options):
                raise ValueError(f"no bucket holds {n} (buckets {options})")
            return options[i]

        if kind == "decode":
            return smallest(self.decode_rows, rows), 1
        width = smallest(self.prefill_tokens, tokens)
        fitting = [r for r, t in self.prefill_shapes() if t == width]
        return smallest(fitting, rows), width


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Column layout of a step's packed int32 input (one row per sequence)."""

    tokens: int  # tokens per row
    table_widths: tuple[tuple[str, int], ...]  # (family, block-table columns), in a fixed order

    # chained: 1 + the row of the previous dispatch (``previous``) whose last token and stop this row continues
    # from, read on the device; 0: the row's token is in ``tokens``
    SCALARS = ("start", "length", "slot", "fresh", "top_k", "seed_hi", "seed_lo", "counter", "budget", "chained")

    @property
    def columns(self) -> dict[str, slice]:
        out, at = {}, 0
        for name, width in (
            [("tokens", self.tokens)]
            + [(s, 1) for s in self.SCALARS]
            + [("stop_ids", DEVICE_STOP_IDS)]
            + [(f"first_page/{f}", 1) for f, _ in self.table_widths]
            + [(f"tables/{f}", w) for f, w in self.table_widths]
        ):
            out[name] = slice(at, at + width)
            at += width
        return out

    @property
    def width(self) -> int:
        return max(s.stop for s in self.columns.values())


@dataclasses.dataclass(frozen=True)
class StepInputs:
    ints: np.ndarray  # [rows, layout.width] int32
    floats: np.ndarray  # [rows, 2] float32: temperature, top-p
    layout: StepLayout
    filters: bool  # some row samples with top-k or top-p (selects the sampler variant)
    logprobs: bool  # some row asks for log-probabilities (else the sampler leaves them out)


def _stop_ids(request, eos_token_ids: Sequence[int]) -> list[int]:
    params = request.params
    return list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))


def _device_stop_ids(request, eos_token_ids: Sequence[int]) -> list[int]:
    """The ids that stop ``request`` on the device: a subset of what the host's stop check finishes it on, so
    a row the device keeps running past a stop is still finished there."""
    return _stop_ids(request, eos_token_ids)[:DEVICE_STOP_IDS]


def device_stops_exactly(request, eos_token_ids: Sequence[int]) -> bool:
    """Whether the device loop stops ``request`` exactly where the host's stop check does: no stop strings, and
    all its stop ids fit the device's list (its token limits are the rows' budgets)."""
    return not request.params.stop and len(_stop_ids(request, eos_token_ids)) <= DEVICE_STOP_IDS


def build_inputs(
    step: ScheduledStep,
    shape: tuple[int, int],
    cache: CacheManager,
    budgets: Sequence[int] | None = None,
    eos_token_ids: Sequence[int] = (),
    in_flight: Sequence[tuple[int, int]] | None = None,
) -> StepInputs:
    """``budgets``: per row, the most tokens a decode step may generate for it (pages are allocated for them).
    ``in_flight``: a decode step chained onto a dispatch the host has not read yet; per row, ``(its row in that
    dispatch, the tokens that dispatch generates for it)``. The row's token then comes from that dispatch, on the
    device."""
    rows, width = shape
    # decode tables span the rows' pages (see cache_manager.MIN_FITTED_TABLE_TOKENS); a prefill step's attention
    # does not size its work by the table, and a width per context would multiply its (slower) compilations
    tables = cache.build_step_tables([row.request.request_id for row in step.rows], rows, fit=width == 1)
    layout = StepLayout(width, tuple((f, t.shape[1]) for f, t in tables.tables.items()))
    col = layout.columns
    ints = np.zeros((rows, layout.width), np.int32)
    floats = np.zeros((rows, 2), np.float32)
    floats[:, 1] = 1.0
    ints[:, col["stop_ids"]] = -1
    seed_words = np.zeros((rows, 2), np.uint32)
    filters = logprobs = False
    first_token = col["tokens"].start
    for i, row in enumerate(step.rows):
        request = row.request
        end, prompt = row.start + row.length, len(request.prompt_ids)
        if in_flight is not None:
            ints[i, col["chained"].start] = 1 + in_flight[i][0]
        elif end <= prompt:
            ints[i, first_token : first_token + row.length] = request.prompt_ids[row.start : end]
        else:
            ints[i, first_token : first_token + row.length] = [request.token(p) for p in range(row.start, end)]
        params = request.params
        seed_words[i] = request.seed >> 32, request.seed & 0xFFFFFFFF
        ints[i, col["start"].start] = row.start
        ints[i, col["length"].start] = row.length
        ints[i, col["fresh"].start] = row.start == 0
        ints[i, col["top_k"].start] = min(params.top_k, np.iinfo(np.int32).max)  # larger means "no limit" anyway
        ints[i, col["counter"].start] = len(request.output_ids) + (0 if in_flight is None else in_flight[i][1])
        ints[i, col["budget"].start] = 1 if budgets is None else budgets[i]
        stop = _device_stop_ids(request, eos_token_ids)
        ints[i, col["stop_ids"].start : col["stop_ids"].start + len(stop)] = stop
        floats[i] = params.temperature, params.top_p
        filters |= params.uses_filters
        logprobs |= params.logprobs
    ints[:, col["seed_hi"].start : col["seed_lo"].start + 1] = seed_words.view(np.int32)
    ints[:, col["slot"].start] = tables.slots
    for family, table in tables.tables.items():
        ints[:, col[f"first_page/{family}"].start] = tables.first_page[family]
        ints[:, col[f"tables/{family}"]] = table
    return StepInputs(ints, floats, layout, filters, logprobs)


def _unpack(ints: jax.Array, layout: StepLayout):
    """The device view of a packed step input: tokens [S, T], a PagedBatch and the per-row scalars."""
    col = layout.columns
    scalar = {name: ints[:, col[name]][:, 0] for name in StepLayout.SCALARS}
    tokens = ints[:, col["tokens"]]
    steps = jnp.arange(layout.tokens, dtype=jnp.int32)
    batch = PagedBatch(
        positions=scalar["start"][:, None] + steps,
        token_mask=steps < scalar["length"][:, None],
        last_index=jnp.maximum(scalar["length"] - 1, 0),
        slots=scalar["slot"],
        fresh=scalar["fresh"] != 0,
        tables={f: ints[:, col[f"tables/{f}"]] for f, _ in layout.table_widths},
        first_page={f: ints[:, col[f"first_page/{f}"]][:, 0] for f, _ in layout.table_widths},
    )
    seeds = jax.lax.bitcast_convert_type(jnp.stack([scalar["seed_hi"], scalar["seed_lo"]], axis=1), jnp.uint32)
    return tokens, batch, scalar, seeds, ints[:, col["stop_ids"]]


def _is_stop_id(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """Whether each row's token is one of its ``DEVICE_STOP_IDS`` stop ids (-1: none), as elementwise ORs over the
    few columns: a reduction over them is a kernel of its own in every decode step."""
    hit = tokens == stop_ids[:, 0]
    for column in range(1, stop_ids.shape[1]):
        hit = hit | (tokens == stop_ids[:, column])
    return hit


def _dispatch_words(seed_words: jax.Array, counters: jax.Array, decode_steps: int) -> jax.Array:
    """The noise words ``uint32[decode_steps, R, 2]`` of every step of a dispatch (step ``i`` of a row draws with
    its key at generation step ``counter + i``), drawn at once ahead of its device loop: drawn inside it they
    were two more small kernels in every step."""
    offsets = jnp.arange(decode_steps, dtype=jnp.uint32)[:, None]
    return jax.vmap(lambda step: draw_words(keys_from_words(seed_words, step)))(counters.astype(jnp.uint32) + offsets)


def _as_padding(batch: PagedBatch, stopped: jax.Array) -> PagedBatch:
    """Rows that stopped become padding: their tokens write only to the sink page and sink slot."""
    return dataclasses.replace(
        batch,
        token_mask=batch.token_mask & ~stopped[:, None],
        slots=jnp.where(stopped, 0, batch.slots),
        tables={f: jnp.where(stopped[:, None], 0, t) for f, t in batch.tables.items()},
    )


@dataclasses.dataclass(frozen=True)
class StepOutputs:
    """A dispatch's results as the host reads them. The packed device array also carries, per row, the last
    token sampled and whether the row stopped, which a chained dispatch reads on the device."""

    tokens: np.ndarray  # [n, rows] int32: the token sampled at each iteration
    logprobs: np.ndarray  # [n, rows] float32
    counts: np.ndarray  # [rows] iterations each row ran before it stopped: its valid tokens are tokens[:count]

    @property
    def steps(self) -> int:
        """Iterations the device ran (decode: 1..decode_steps; prefill: 1)."""
        return int(self.counts.max(initial=1))


def _pack_outputs(tokens, logprobs, counts, last, stopped) -> jax.Array:
    """One int32 array [2n + 3, rows], so the host reads a step's results with a single transfer: tokens,
    log-probabilities, counts, then the chaining carry (each row's last token, whether it stopped)."""
    bits = jax.lax.bitcast_convert_type(logprobs.astype(jnp.float32), jnp.int32)
    carry = jnp.stack([last, stopped]).astype(jnp.int32)
    return jnp.concatenate([tokens, bits, counts[None].astype(jnp.int32), carry])


def _carry_of(previous: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(last token, finished) of these rows of a previous dispatch, from its packed outputs."""
    return previous[-2][rows], previous[-1][rows] != 0


def unpack_outputs(packed) -> StepOutputs:
    if isinstance(packed, jax.Array) and not packed.is_fully_addressable:  # replicated over a multi-host mesh
        packed = packed.addressable_data(0)
    packed = np.asarray(packed)
    n = (packed.shape[0] - 3) // 2
    return StepOutputs(packed[:n], packed[n : 2 * n].view(np.float32), packed[2 * n])


def pad_to_power_of_two(ids) -> np.ndarray:
    """int32 ids padded with the sink (0) to a power-of-two length, so few shapes compile."""
    ids = np.asarray(ids, np.int32).reshape(-1)
    out = np.zeros(1 << max(0, len(ids) - 1).bit_length(), np.int32)
    out[: len(ids)] = ids
    return out


@functools.partial(jax.jit, static_argnames=("layers",), donate_argnums=(0,))
def _copy_rows(cache, source, destination, *, layers):
    # Rows are the leading axis of every state array; a tensor-parallel split is on a later (head) axis, so
    # the copy needs no communication.
    cache = list(cache)
    for i in layers:
        cache[i] = jax.tree.map(lambda a: a.at[destination].set(a[source]), cache[i])
    return tuple(cache)


# XLA options for the decode steps' compilation (one token per row; the CPU compiler ignores GPU options). Triton
# multi-output fusions, meant to let XLA fuse the RMS norm before the gate/up projection into the sum of the output
# projection's split-K partials (that sum also writes the residual), took ~2-3% off the 0.5B decode step at 32
# rows (H200, docs/BENCHMARKS.md). Prefill steps, where they were not measured, compile without them. XLA calls
# the option unsupported: every golden case's engine test and the chained-decode tests (stops and aborts inside
# chained dispatches) passed with it on the GPU; the parity check there runs ModelRunner, not this step.
DECODE_COMPILER_OPTIONS = {"xla_gpu_unsupported_enable_triton_multi_output_fusion": True}


class StepRunner:
    """Owns the model parameters and the jitted steps; counts compilations (each trace is one).

    A :class:`~apriel2_jax.tensor_parallel.ShardedModel` runs the same step inside ``shard_map``: each device
    merges its blocks of the parameters and caches into the per-device model; the step's inputs and outputs are
    replicated, so the host side is unchanged."""

    def __init__(self, model: Apriel2ForCausalLM | ShardedModel, log: Callable[[str], None] | None = None):
        self.sharded = model if isinstance(model, ShardedModel) else None
        if self.sharded is not None:
            self.graphdef, self.param_leaves, self.param_tree = model.graphdef, model.param_leaves, model.param_tree
        else:
            self.graphdef, params = nnx.split(model)
            # Flat leaves: passing the nnx State itself costs ~1 ms of pytree flattening on every call.
            self.param_leaves, self.param_tree = jax.tree.flatten(params)
        self.compilations = 0
        self.log = log
        self._cache_specs: dict = {}
        jit = functools.partial(
            jax.jit,
            static_argnames=("cache_tree", "cache_specs", "layout", "placement", "decode_steps", "filters",
                             "logprobs", "stop_checks"),
            donate_argnums=(1,),
        )
        self._prefill_step = jit(self._step_fn)
        self._decode_step = jit(self._step_fn, compiler_options=DECODE_COMPILER_OPTIONS)
        self._no_previous: dict[tuple[int, int], jax.Array] = {}

    def _step_fn(self, param_leaves, cache_leaves, ints, floats, previous, *, cache_tree, cache_specs, **static):
        self.compilations += 1  # Python runs here only while tracing, i.e. once per compiled shape
        body = functools.partial(self._step_body, cache_tree=cache_tree, **static)
        if self.sharded is None:
            return body(param_leaves, cache_leaves, ints, floats, previous)
        specs = list(cache_specs)
        return jax.shard_map(
            body, mesh=self.sharded.mesh, in_specs=(self.sharded.param_specs, specs, P(), P(), P()),
            out_specs=(P(), specs), check_vma=False,
        )(param_leaves, cache_leaves, ints, floats, previous)

    def _step_body(self, param_leaves, cache_leaves, ints, floats, previous, *, cache_tree, layout, placement,
                   decode_steps, filters, logprobs, stop_checks):
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self.param_tree, param_leaves))
        cache = cache_tree.unflatten(cache_leaves)
        tokens, batch, scalar, seeds, stop_ids = _unpack(ints, layout)
        temperature, top_p = floats[:, 0], floats[:, 1]
        chained = scalar["chained"] > 0
        previous_last, previous_finished = _carry_of(previous, jnp.maximum(scalar["chained"] - 1, 0))
        if layout.tokens == 1:
            tokens = jnp.where(chained[:, None], previous_last[:, None], tokens)
        # Padding rows, and rows the chained-onto dispatch finished (a stop id): they run as padding.
        stopped = (scalar["budget"] <= 0) | (chained & previous_finished)

        def finished(last, counts):
            """Rows whose request ends here (padding, or a stop id; not a budget that merely ran out): a
            dispatch chained onto this one runs them as padding."""
            hit = _is_stop_id(last, stop_ids)
            return stopped | hit | (counts < scalar["budget"])

        words = _dispatch_words(seeds, scalar["counter"], decode_steps)

        def one(tokens, batch, cache, i):
            logits, cache = model.forward_paged(tokens, batch, cache, placement)
            next_tokens, token_logprobs = sample_words(
                logits.astype(jnp.float32), temperature, scalar["top_k"], top_p,
                jax.lax.dynamic_index_in_dim(words, i, keepdims=False), filters=filters, logprobs=logprobs,
            )
            return next_tokens, token_logprobs, cache

        rows = ints.shape[0]
        if decode_steps == 1:
            # Padding rows are padding already; only a row a chained-onto dispatch finished needs turning into it.
            step_batch = _as_padding(batch, chained & previous_finished)
            next_tokens, token_logprobs, cache = one(tokens, step_batch, cache, 0)
            counts = jnp.where(chained & previous_finished, 0, 1).astype(jnp.int32)
            packed = _pack_outputs(next_tokens[None], token_logprobs[None], counts, next_tokens,
                                   finished(next_tokens, counts))
            return packed, jax.tree.leaves(cache)

        def body(carry):
            i, tokens, cache, out_tokens, out_logprobs, stopped, counts = carry
            step_batch = _as_padding(dataclasses.replace(batch, positions=batch.positions + i), stopped)
            next_tokens, token_logprobs, cache = one(tokens, step_batch, cache, i)
            out_tokens = jax.lax.dynamic_update_index_in_dim(out_tokens, next_tokens, i, 0)
            if logprobs:  # else they stay the zeros they start as: no update kernel in every step
                out_logprobs = jax.lax.dynamic_update_index_in_dim(out_logprobs, token_logprobs, i, 0)
            counts = counts + (~stopped).astype(jnp.int32)
            hit = _is_stop_id(next_tokens, stop_ids) | (i + 1 >= scalar["budget"])
            return i + 1, next_tokens[:, None], cache, out_tokens, out_logprobs, stopped | hit, counts

        def running(carry):
            i, stopped = carry[0], carry[5]
            return (i < decode_steps) & ~jnp.all(stopped)

        # Iterations run in groups of known trip count, which XLA runs without reading a predicate on the host;
        # the stop check between groups is such a read (a host round trip with the device idle, and the call
        # returns only when the loop has ended). Without stop checks the loop is one group.
        group = stop_check_group(decode_steps) if stop_checks else decode_steps

        def iterations(carry):
            return jax.lax.fori_loop(0, group, lambda _, c: body(c), carry)

        carry = (
            jnp.int32(0),
            tokens,
            cache,
            jnp.zeros((decode_steps, rows), jnp.int32),
            jnp.zeros((decode_steps, rows), jnp.float32),
            stopped,
            jnp.zeros((rows,), jnp.int32),
        )
        if group == decode_steps:
            carry = iterations(carry)
        else:
            carry = jax.lax.while_loop(running, iterations, carry)
        _, last, cache, out_tokens, out_logprobs, _, counts = carry
        packed = _pack_outputs(out_tokens, out_logprobs, counts, last[:, 0], finished(last[:, 0], counts))
        return packed, jax.tree.leaves(cache)

    def run(self, cache, inputs: StepInputs, placement: Placement, decode_steps: int = 1, *,
            previous: jax.Array | None = None, stop_checks: bool = True):
        """Runs one step; returns its outputs (a device array: pass it to :func:`unpack_outputs`) and the
        updated cache. ``decode_steps`` > 1 only for decode steps (one token per row).

        ``previous``: the outputs of the dispatch this one is chained onto (rows marked ``chained`` in the
        inputs take their token from it). ``stop_checks=False`` runs all ``decode_steps`` iterations without
        checking whether every row has stopped: the call returns once the dispatch is queued."""
        if decode_steps > 1 and inputs.layout.tokens != 1:
            raise ValueError("several steps per dispatch are for decode steps only (one token per row)")
        rows = inputs.ints.shape[0]
        if previous is None:
            previous = self._no_previous.get((decode_steps, rows))
            if previous is None:
                previous = np.zeros((2 * decode_steps + 3, rows), np.int32)
                if self.sharded is not None:  # placed like a chained dispatch's outputs: one compiled signature
                    previous = jax.device_put(previous, NamedSharding(self.sharded.mesh, P()))
                else:
                    previous = jax.device_put(previous)
                self._no_previous[decode_steps, rows] = previous
        elif previous.shape != (2 * decode_steps + 3, rows):
            raise ValueError(f"a chained dispatch needs the previous dispatch's outputs of {rows} rows and "
                             f"{decode_steps} steps, got an array of shape {previous.shape}")
        leaves, cache_tree = jax.tree.flatten(cache)
        stop_checks = stop_checks and stop_check_group(decode_steps) < decode_steps  # one compiled variant if equal
        compilations, start = self.compilations, time.monotonic()
        step = self._decode_step if inputs.layout.tokens == 1 else self._prefill_step
        outputs, leaves = step(
            self.param_leaves,
            leaves,
            inputs.ints,
            inputs.floats,
            previous,
            cache_tree=cache_tree,
            cache_specs=self._specs_of(cache, cache_tree),
            layout=inputs.layout,
            placement=placement,
            decode_steps=decode_steps,
            filters=inputs.filters,
            logprobs=inputs.logprobs,
            stop_checks=stop_checks,
        )
        if self.compilations > compilations and self.log is not None:  # this call traced (and compiled) a shape
            width = inputs.layout.tokens
            what = f"decode rows={rows} steps={decode_steps}" if width == 1 else f"prefill rows={rows} tokens={width}"
            if width == 1 and inputs.layout.table_widths:
                what += ", tables " + " ".join(f"{f}={w}" for f, w in inputs.layout.table_widths)
            if width == 1 and decode_steps > 1 and not stop_checks:
                what += ", no stop checks"
            sampler = (", top-k/top-p sampler" if inputs.filters else "") + (", log-probabilities" if inputs.logprobs
                                                                             else "")
            self.log(f"compiled step ({what}{sampler}) in {time.monotonic() - start:.1f}s")
        return outputs, cache_tree.unflatten(leaves)

    def copy_state_rows(self, cache, layers: tuple[int, ...], pairs: Sequence[tuple[int, int]]):
        """Copy rows of every recurrent layer's state arrays (conv and SSM), ``(source, destination)`` pairs at
        once: prefix-cache snapshots saved from state slots or restored into them. Pairs are padded to a power
        of two with sink-to-sink copies, so few shapes compile."""
        if not pairs:
            return cache
        source, destination = zip(*pairs)
        return _copy_rows(cache, pad_to_power_of_two(source), pad_to_power_of_two(destination), layers=tuple(layers))

    def _specs_of(self, cache, cache_tree) -> tuple | None:
        if self.sharded is None:
            return None
        if cache_tree not in self._cache_specs:
            self._cache_specs[cache_tree] = self.sharded.cache_specs(cache)
        return self._cache_specs[cache_tree]

    def warm_up(
        self,
        cache,
        shapes: Sequence[tuple[int, int]],
        cache_manager: CacheManager,
        placement: Placement,
        decode_steps: int = 1,
        progress: Callable[[str], None] | None = None,
        both_samplers: bool = False,
    ):
        """Compile ``shapes`` now (padding-only inputs: all rows hit the sink), so serving them never waits.
        ``both_samplers`` also compiles each shape's top-k/top-p sampler variant. The variants computing
        log-probabilities compile when a request first asks for them. A decode shape compiles both
        loop variants: with stop checks (dispatches whose rows may stop early on their budget) and without
        (every row's budget is the whole dispatch: the variant chained dispatches use)."""
        empty = ScheduledStep("prefill", (), ())
        start = time.monotonic()
        variants = []
        for shape in shapes:
            steps = decode_steps if shape[1] == 1 else 1
            loops = (True, False) if stop_check_group(steps) < steps else (True,)
            for filters in (False, True) if both_samplers else (False,):
                variants += [(shape, filters, stop_checks) for stop_checks in loops]
        log, self.log = self.log, None
        try:
            for i, (shape, filters, stop_checks) in enumerate(variants, start=1):
                if progress is not None:
                    progress(f"compiling step {i}/{len(variants)} (rows={shape[0]}, tokens={shape[1]}"
                             f"{', top-k/top-p sampler' if filters else ''}"
                             f"{'' if stop_checks else ', no stop checks'}), {time.monotonic() - start:.0f}s so far")
                inputs = dataclasses.replace(build_inputs(empty, shape, cache_manager), filters=filters)
                _, cache = self.run(cache, inputs, placement, decode_steps if shape[1] == 1 else 1,
                                    stop_checks=stop_checks)
        finally:
            self.log = log
        if progress is not None:
            progress(f"compiled {len(variants)} steps in {time.monotonic() - start:.1f}s; other shapes compile "
                     f"when first needed")
        return cache
