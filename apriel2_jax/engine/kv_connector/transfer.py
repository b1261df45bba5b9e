"""Device <-> host copies of prefix entries: attention pages of every family and recurrent-state rows, gathered
into host numpy arrays (one jitted gather per call, one transfer) and scattered back into other page ids and
rows. Array names are ``"{family}/{layer}/{k|v}"`` for pages and ``"state/{layer}/{name}"`` for state rows, so an
entry read under one page or slot id can be written under any other of the same placement."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..cache_layout import CacheLayout
from ..step import pad_to_power_of_two


def _page_leaves(layout: CacheLayout):
    return [(fam.key, layer, name) for fam in layout.attention for layer in fam.layers for name in ("k", "v")]


@functools.partial(jax.jit, static_argnames=("layers",))
def _gather(cache, ids, *, layers):
    return {f"{tag}/{layer}/{name}": cache[layer][name][ids[tag]] for tag, layer, name in layers}


@functools.partial(jax.jit, static_argnames=("layers",), donate_argnums=(0,))
def _scatter(cache, ids, values, *, layers):
    cache = list(cache)
    for tag, layer, name in layers:
        entry = dict(cache[layer])
        rows, n = values[f"{tag}/{layer}/{name}"], ids[tag].shape[0]
        # Values may carry more rows than ids (a loaded buffer) or fewer (ids padded to a power of two): padding
        # rows rewrite the sink with zeros; it is never read unmasked.
        rows = rows[:n] if rows.shape[0] >= n else jnp.pad(rows, [(0, n - rows.shape[0])] + [(0, 0)] * (rows.ndim - 1))
        entry[name] = entry[name].at[ids[tag]].set(rows.astype(entry[name].dtype))
        cache[layer] = entry
    return tuple(cache)


def _layers(cache, layout: CacheLayout, families, with_state: bool) -> tuple:
    layers = [leaf for leaf in _page_leaves(layout) if leaf[0] in families]
    if with_state and layout.state is not None:
        layers += [("state", layer, name) for layer in layout.state.layers for name in sorted(cache[layer])]
    return tuple(layers)


def row_specs(cache, layout: CacheLayout) -> tuple[dict, dict]:
    """(page entry specs, state entry specs): name -> (shape, dtype) of one row of every array an entry carries
    under this cache's placement."""
    families = {fam.key for fam in layout.attention}
    specs = ({}, {})
    for tag, layer, name in _layers(cache, layout, families, True):
        array = cache[layer][name]
        specs[tag == "state"][f"{tag}/{layer}/{name}"] = (tuple(array.shape[1:]), np.dtype(array.dtype))
    return specs


def _padded_ids(pages: dict[str, np.ndarray], state_rows: np.ndarray | None) -> dict[str, np.ndarray]:
    ids = {family: pad_to_power_of_two(p) for family, p in pages.items()}
    if state_rows is not None:
        ids["state"] = pad_to_power_of_two(state_rows)
    return ids


def gather_rows(cache, layout: CacheLayout, pages: dict[str, np.ndarray], state_rows: np.ndarray | None = None):
    """Start copying ``pages[family]`` (page ids) of every layer of each family and ``state_rows`` of every
    recurrent layer out of the cache: ``({name: device array [n_padded, ...]}, {family or "state": n})``. The
    gather is dispatched, not waited for: a worker thread can move the result to the host while the next step
    runs (its output buffers are the gather's own, so donating the cache to that step is safe)."""
    ids = _padded_ids(pages, state_rows)
    layers = _layers(cache, layout, set(pages), state_rows is not None)
    counts = {family: len(p) for family, p in pages.items()}
    if state_rows is not None:
        counts["state"] = len(state_rows)
    return _gather(cache, ids, layers=layers), counts


def to_host(gathered, counts: dict[str, int]) -> dict[str, np.ndarray]:
    """Host arrays of :func:`gather_rows`'s result, padding rows dropped."""
    out = jax.device_get(gathered)
    return {name: np.asarray(a)[: counts[name.split("/")[0]]] for name, a in out.items()}


def read_rows(cache, layout: CacheLayout, pages: dict[str, np.ndarray], state_rows: np.ndarray | None = None):
    """Host copies of ``pages[family]`` (page ids) of every layer of each family and of ``state_rows`` of every
    recurrent layer: ``{name: array [n, ...]}`` with ``n`` the number of ids asked for that family/state."""
    return to_host(*gather_rows(cache, layout, pages, state_rows))


def write_rows(cache, layout: CacheLayout, pages: dict[str, np.ndarray], values: dict, state_rows: np.ndarray | None = None):
    """Write ``values`` (as returned by :func:`read_rows`: rows in the order of ``pages[family]`` and
    ``state_rows``; host or device arrays, extra rows ignored) into those pages and rows; returns the updated
    cache (the old one is donated)."""
    layers = _layers(cache, layout, set(pages), state_rows is not None)
    values = {f"{tag}/{layer}/{name}": values[f"{tag}/{layer}/{name}"] for tag, layer, name in layers}
    return _scatter(cache, _padded_ids(pages, state_rows), values, layers=layers)
