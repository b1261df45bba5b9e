"""Placements: which sub-mixer each supernet layer runs.

A resolved placement is a tuple with one entry per layer: the sub-mixer name for stochastic layers and None
for fixed layers. It is static (hashable) so that it can key a compiled function; switching placement never
touches the weights, which hold every sub-mixer.
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Sequence, Union

from .config import Apriel2Config, LeafMixerConfig, StochasticConfig

Placement = tuple[Union[str, None], ...]
PlacementSpec = Union[None, str, Sequence[Union[str, None]], Mapping[Union[str, int], str]]

# Spellings accepted for the conventional sub-mixer names (the reference's test script accepts these too).
_ALIASES = {"swa": "sliding_window", "attn": "attention"}


class PlacementError(ValueError):
    pass


def load_placements(path: str | os.PathLike) -> dict[str, dict[str, str]]:
    """Read a ``placements.json`` (name -> {"layer index": "mixer name"}) from a file or checkpoint directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "placements.json")
    with open(path) as f:
        try:
            data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise PlacementError(f"{path}: not valid JSON ({err}); expected an object of named placements") from None
    if not isinstance(data, dict) or not all(isinstance(v, (dict, list)) for v in data.values()):
        raise PlacementError(f"{path}: expected an object of named placements, each a {{layer: mixer}} object or a list")
    return data


def _canonical(name: str, layer: int, mixer: StochasticConfig) -> str:
    if name in mixer.names:
        return name
    alias = _ALIASES.get(name)
    if alias in mixer.names:
        return alias
    raise PlacementError(f"layer {layer}: unknown mixer {name!r}; this layer's mixers are {list(mixer.names)}")


def _names_fixed_layer(name: str, mixer: LeafMixerConfig) -> bool:
    """Whether a placement's ``name`` for a fixed layer describes it: its type (or an alias of it), or for a
    sliding-window attention layer ``sliding_window`` / ``swa``."""
    canonical = _ALIASES.get(name, name)
    if canonical == mixer.kind:
        return True
    return canonical == "sliding_window" and getattr(mixer, "is_sliding", False)


def resolve_placement(
    config: Apriel2Config, spec: PlacementSpec = None, named: Mapping[str, object] | None = None
) -> Placement:
    """Turn a placement spec into a resolved placement.

    ``spec`` is None (every layer's ``main_mixer_name``), a name from ``named`` (a loaded placements.json), a
    list with one mixer name per layer (None or the mixer type for fixed layers), or a {layer: name} mapping
    that must cover every stochastic layer.
    """
    if isinstance(spec, str):
        if named is None or spec not in named:
            known = sorted(named) if named else []
            raise PlacementError(f"unknown placement {spec!r}; known placements: {known}")
        try:
            return resolve_placement(config, named[spec])  # type: ignore[arg-type]
        except PlacementError as err:
            raise PlacementError(f"placement {spec!r}: {err}") from None
    resolved: list[str | None] = []
    if spec is None:
        for block in config.blocks:
            resolved.append(block.mixer.main_mixer_name if isinstance(block.mixer, StochasticConfig) else None)
        return tuple(resolved)
    if isinstance(spec, Mapping):
        by_layer: dict[int, str] = {}
        for key, name in spec.items():
            try:
                layer = int(key)
            except (TypeError, ValueError):
                raise PlacementError(f"placement key {key!r} is not a layer index") from None
            if not 0 <= layer < config.num_blocks:
                raise PlacementError(f"placement names layer {layer}, but the model has {config.num_blocks} layers")
            by_layer[layer] = name
        for i, block in enumerate(config.blocks):
            if isinstance(block.mixer, StochasticConfig):
                if i not in by_layer:
                    raise PlacementError(f"placement does not name a mixer for stochastic layer {i}")
                resolved.append(_canonical(by_layer[i], i, block.mixer))
            else:
                if i in by_layer and not _names_fixed_layer(by_layer[i], block.mixer):
                    raise PlacementError(
                        f"layer {i} is a fixed {block.mixer.kind} layer; the placement asks for {by_layer[i]!r}"
                    )
                resolved.append(None)
        return tuple(resolved)
    names = list(spec)
    if len(names) != config.num_blocks:
        raise PlacementError(f"placement lists {len(names)} mixers, but the model has {config.num_blocks} layers")
    for i, (name, block) in enumerate(zip(names, config.blocks)):
        if isinstance(block.mixer, StochasticConfig):
            if name is None:
                raise PlacementError(f"placement gives no mixer for stochastic layer {i}")
            resolved.append(_canonical(name, i, block.mixer))
        else:
            if name is not None and not _names_fixed_layer(name, block.mixer):
                raise PlacementError(f"layer {i} is a fixed {block.mixer.kind} layer; the placement asks for {name!r}")
            resolved.append(None)
    return tuple(resolved)


def active_mixer(config: Apriel2Config, placement: Placement, layer: int) -> LeafMixerConfig:
    mixer = config.blocks[layer].mixer
    if isinstance(mixer, StochasticConfig):
        return mixer.mixer(placement[layer])  # type: ignore[arg-type]
    return mixer
