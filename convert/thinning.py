"""Thinning a supernet config: each stochastic layer keeps only the mixers some placements use.

Plain JSON work on ``config.json`` (the HF layout is kept: a layer left with one mixer becomes a plain mixer of
that type, several stay a stochastic mixer over them), plus where each kept tensor comes from in the source.
"""

from __future__ import annotations

import json
from typing import Sequence

from apriel2_jax.config import StochasticConfig


def _layer_blocks(raw: dict, num_blocks: int) -> list[dict]:
    decoder = raw["decoder"]
    if decoder.get("type", "fixed") == "fixed":
        return [decoder["block"]] * num_blocks
    pattern = decoder["pattern"]
    return [decoder["blocks"][pattern[i % len(pattern)]] for i in range(num_blocks)]


def thin(raw: dict, config, keep: Sequence[set[str] | None]) -> tuple[dict, dict[str, str]]:
    """``raw`` (config.json) with stochastic layer i reduced to the mixers ``keep[i]``; and the source prefix of
    every kept mixer's keys in the new layout."""
    blocks, renames = [], {}
    for i, (block_raw, block) in enumerate(zip(_layer_blocks(raw, config.num_blocks), config.blocks)):
        block_raw = json.loads(json.dumps(block_raw))
        mixer = block.mixer
        if isinstance(mixer, StochasticConfig):
            names = [n for n in mixer.names if n in keep[i]]
            subs = block_raw["mixer"]["mixers"]
            if len(names) == 1:
                block_raw["mixer"] = subs[names[0]]
                renames[f"model.decoder.blocks.{i}.mixer."] = f"model.decoder.blocks.{i}.mixer.mixers.{names[0]}."
            else:
                main = mixer.main_mixer_name if mixer.main_mixer_name in names else names[0]
                block_raw["mixer"] = dict(block_raw["mixer"], mixers={n: subs[n] for n in names}, main_mixer_name=main)
        blocks.append((block_raw, _block_name(block_raw, mixer, keep[i])))
    out = json.loads(json.dumps(raw))
    if all(b == blocks[0][0] for b, _ in blocks):
        out["decoder"] = {"type": "fixed", "num_blocks": config.num_blocks, "block": blocks[0][0]}
    else:
        named: dict[str, dict] = {}
        pattern = []
        for block_raw, name in blocks:
            base, k = name, 1
            while name in named and named[name] != block_raw:
                k += 1
                name = f"{base}_{k}"
            named[name] = block_raw
            pattern.append(name)
        out["decoder"] = {"type": "pattern", "num_blocks": config.num_blocks, "pattern": pattern, "blocks": named}
    return out, renames


def _block_name(block_raw: dict, mixer, keep) -> str:
    """Blocks are named after their mixer (what vLLM's pattern-config path expects of a thinned supernet)."""
    if isinstance(mixer, StochasticConfig):
        names = [n for n in mixer.names if n in keep]
        return names[0] if len(names) == 1 else "+".join(names)
    return block_raw["mixer"].get("type", "attention")


def source_key(key: str, renames: dict[str, str]) -> str:
    for new, old in renames.items():
        if key.startswith(new):
            return old + key[len(new):]
    return key
