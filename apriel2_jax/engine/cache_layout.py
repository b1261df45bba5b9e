"""Cache families at natural sizes, and how many pages and state slots a memory budget buys.

A family is a set of layers that allocate identically: full attention, one per distinct sliding-window width,
and one state family for every recurrent layer (GDN, KDA, Mamba). Each family has one id space; each layer keeps
its own arrays at its own natural shape. No page is padded to another family's size (the vLLM bug where
attention pages were inflated to the size of a recurrent state), and the family count is O(kinds), not
O(layers) (the vLLM bug of one KV-cache group per layer).

Plain Python: no JAX here.
"""

from __future__ import annotations

import dataclasses
import math

from ..config import Apriel2Config, AttentionConfig, GDNConfig, KDAConfig, MambaConfig
from ..placement import Placement, active_mixer

SINK = 0  # page 0 of every page pool and slot 0 of the state pool absorb padded rows; never allocated


class CacheConfigError(ValueError):
    """The cache cannot be built as configured; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class AttentionFamily:
    key: str  # "full" or "window_{W}"
    window: int | None
    layers: tuple[int, ...]
    token_bytes: int  # K and V bytes of one token over all layers of the family


@dataclasses.dataclass(frozen=True)
class StateFamily:
    layers: tuple[int, ...]
    slot_bytes: int  # conv + recurrent state bytes of one sequence over all recurrent layers


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    attention: tuple[AttentionFamily, ...]
    state: StateFamily | None

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(f.key for f in self.attention) + (("state",) if self.state else ())


def _state_bytes(cfg, dtype_bytes: int) -> int:
    if isinstance(cfg, GDNConfig):
        conv = (cfg.conv_kernel_size - 1) * cfg.conv_channels * dtype_bytes
        return conv + cfg.value_heads * cfg.key_head_dim * cfg.value_head_dim * 4
    if isinstance(cfg, KDAConfig):
        conv = 3 * (cfg.conv_kernel_size - 1) * cfg.projection_size * dtype_bytes
        return conv + cfg.heads * cfg.head_dim * cfg.head_dim * 4
    if isinstance(cfg, MambaConfig):
        return (cfg.d_conv - 1) * cfg.conv_channels * dtype_bytes + cfg.d_inner * cfg.state_size * 4
    raise TypeError(cfg)


def cache_layout(config: Apriel2Config, placement: Placement, dtype_bytes: int) -> CacheLayout:
    """Families of the layers that run under ``placement`` (recurrent states are fp32, conv states dtype)."""
    attention: dict[str, list] = {}
    recurrent: list[int] = []
    slot_bytes = 0
    for i in range(config.num_blocks):
        mixer = active_mixer(config, placement, i)
        if isinstance(mixer, AttentionConfig):
            entry = attention.setdefault(mixer.cache_family, [mixer.window_size, [], 0])
            entry[1].append(i)
            entry[2] += 2 * mixer.head_groups * mixer.head_size * dtype_bytes
        else:
            recurrent.append(i)
            slot_bytes += _state_bytes(mixer, dtype_bytes)
    families = tuple(
        AttentionFamily(key, window, tuple(layers), token_bytes)
        for key, (window, layers, token_bytes) in sorted(attention.items(), key=lambda kv: (kv[1][0] or 1 << 62))
    )
    return CacheLayout(families, StateFamily(tuple(recurrent), slot_bytes) if recurrent else None)


@dataclasses.dataclass(frozen=True)
class CachePlan:
    page_size: int
    pages: dict[str, int]  # family -> pages in the pool, sink included
    table_width: dict[str, int]  # family -> block-table columns a row needs at most
    slots: int  # state slots, sink included (0 if no recurrent layer)
    bytes: dict[str, int]  # family -> bytes of its arrays ("snapshots": the prefix cache's state snapshots)
    snapshots: int = 0  # prefix-cache state snapshots, stored in the state arrays' rows after the slots

    def token_capacity(self, family: str) -> int:
        return (self.pages[family] - 1) * self.page_size

    def summary(self, layout: CacheLayout) -> str:
        parts = []
        for fam in layout.attention:
            parts.append(
                f"{fam.key}: {len(fam.layers)} layers, {self.pages[fam.key] - 1} pages x {self.page_size} tokens "
                f"= {self.token_capacity(fam.key)} tokens, {self.bytes[fam.key] / 2**20:.1f} MiB"
            )
        if layout.state:
            parts.append(
                f"state: {len(layout.state.layers)} layers, {self.slots - 1} slots, "
                f"{self.bytes['state'] / 2**20:.1f} MiB"
            )
            if self.snapshots:
                parts.append(f"prefix snapshots: {self.snapshots}, {self.bytes['snapshots'] / 2**20:.1f} MiB")
        return "; ".join(parts) if parts else "no cache"


def window_table_width(window: int, page_size: int, max_chunk: int) -> int:
    """Pages a row of a window family holds at most: the queries of a chunk of ``max_chunk`` tokens see back
    ``window - 1`` positions, and the span may straddle one more page boundary."""
    return math.ceil((window - 1 + max_chunk) / page_size) + 1


def plan_cache(
    layout: CacheLayout,
    *,
    budget_bytes: int,
    page_size: int,
    max_num_seqs: int,
    max_model_len: int,
    max_chunk: int,
    snapshot_bytes: int = 0,
) -> CachePlan:
    """Split ``budget_bytes`` between the families: state slots for ``max_num_seqs`` sequences, window pools
    for every sequence's window, and the rest to full attention (at least one ``max_model_len`` sequence).
    Prefix-cache state snapshots take up to ``snapshot_bytes`` of what is left after those minimums."""
    if page_size < 1 or max_num_seqs < 1 or max_model_len < 1 or max_chunk < 1:
        raise CacheConfigError("page_size, max_num_seqs, max_model_len and max_chunk must all be >= 1")
    full_width = math.ceil(max_model_len / page_size)
    pages, widths, nbytes = {}, {}, {}
    used = 0
    slots = 0
    snapshots = 0
    if layout.state:
        slots = max_num_seqs + 1
        nbytes["state"] = slots * layout.state.slot_bytes
        used += nbytes["state"]
    full = None
    for fam in layout.attention:
        if fam.window is None:
            full = fam
            continue
        width = min(window_table_width(fam.window, page_size, max_chunk), full_width)
        widths[fam.key] = width
        pages[fam.key] = max_num_seqs * width + 1
        nbytes[fam.key] = pages[fam.key] * page_size * fam.token_bytes
        used += nbytes[fam.key]
    if used > budget_bytes:
        raise CacheConfigError(
            f"the cache budget of {budget_bytes / 2**20:.1f} MiB cannot hold the recurrent states and sliding "
            f"windows of max_num_seqs={max_num_seqs} sequences ({used / 2**20:.1f} MiB needed): lower "
            f"max_num_seqs or raise the memory budget"
        )
    if layout.state and snapshot_bytes > 0:
        full_minimum = (full_width + 1) * page_size * full.token_bytes if full is not None else 0
        room = max(0, min(snapshot_bytes, budget_bytes - used - full_minimum))
        snapshots = room // layout.state.slot_bytes
        nbytes["snapshots"] = snapshots * layout.state.slot_bytes
        used += nbytes["snapshots"]
    if full is not None:
        page_bytes = page_size * full.token_bytes
        count = (budget_bytes - used) // page_bytes - 1  # usable pages; the sink takes one more
        if count < full_width:
            need = used + (full_width + 1) * page_bytes
            raise CacheConfigError(
                f"the cache budget of {budget_bytes / 2**20:.1f} MiB leaves room for {max(count, 0) * page_size} tokens of "
                f"full attention, less than one sequence of max_model_len={max_model_len} ({need / 2**20:.1f} MiB "
                f"needed): lower max_model_len or max_num_seqs, or raise the memory budget"
            )
        widths[full.key] = full_width
        pages[full.key] = int(count) + 1
        nbytes[full.key] = pages[full.key] * page_bytes
    return CachePlan(page_size, pages, widths, slots, nbytes, snapshots)
