"""Placements: which sub-mixer each supernet layer runs.

A resolved placement is a tuple with one entry per layer: the sub-mixer name for stochastic layers and None
for fixed layers. It is static (hashable) so that it can key a compiled function; switching placement never
touches the weights, which hold every sub-mixer.
"""

from __future__ import annotations

import json
import os
import re
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
            raise PlacementError(
                f"{path}: not valid JSON ({err}); expected an object of named placements"
            ) from None
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


def _fixed_layer_accepts(name: str, block) -> bool:
    """A fixed layer takes its mixer type or the name of its block (or an alias of either): a conversion that
    leaves a supernet layer one mixer names that layer's block after it (``NAME``, or ``NAME_2``... where such
    layers differ), so placements written for the supernet still select the converted model."""
    for spelling in {name, _ALIASES.get(name, name)}:
        if spelling in (block.mixer.kind, block.name) or re.fullmatch(re.escape(spelling) + r"_[0-9]+", block.name):
            return True
    return False


def _fixed_layer_error(layer: int, block, name: str) -> str:
    return (f"layer {layer} is a fixed {block.mixer.kind} layer; the placement asks for {name!r} (a fixed layer takes "
            f"its type {block.mixer.kind!r} or its block name {block.name!r})")


def resolve_placement(
    config: Apriel2Config, spec: PlacementSpec = None, named: Mapping[str, object] | None = None
) -> Placement:
    """Turn a placement spec into a resolved placement.

    ``spec`` is None (every layer's ``main_mixer_name``), a name from ``named`` (a loaded placements.json), a
    list with one mixer name per layer (None, the mixer type or the block name for fixed layers), or a
    {layer: name} mapping that must cover every stochastic layer.
    """
    if isinstance(spec, str):
        if named is None or spec not in named:
            known = sorted(named) if named else []
            raise PlacementError(f"unknown placement {spec!r}; known placements: {known}")
        spec = named[spec]  # type: ignore[assignment]
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
                if i in by_layer and not _fixed_layer_accepts(by_layer[i], block):
                    raise PlacementError(_fixed_layer_error(i, block, by_layer[i]))
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
            if name is not None and not _fixed_layer_accepts(name, block):
                raise PlacementError(_fixed_layer_error(i, block, name))
            resolved.append(None)
    return tuple(resolved)


def active_mixer(config: Apriel2Config, placement: Placement, layer: int) -> LeafMixerConfig:
    mixer = config.blocks[layer].mixer
    if isinstance(mixer, StochasticConfig):
        return mixer.mixer(placement[layer])  # type: ignore[arg-type]
    return mixer
