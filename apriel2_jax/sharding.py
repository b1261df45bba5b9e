"""Tensor parallelism: the device mesh, how every parameter and cache is split over it, and the per-device config.

Megatron-style: the residual stream is replicated; each device runs its share of every mixer's heads and of the
MLP's intermediate channels, and the output projections (``o_proj``, ``out_proj``, ``down_proj``) are summed
over the mesh axis. Embedding and LM head are split by vocabulary rows.

How n heads go over tp devices (``split_heads``):

* n a multiple of tp: device d holds heads [d·n/tp, (d+1)·n/tp).
* n not a multiple and n > tp: heads are padded to the next multiple with zero heads (zero weights in, zero
  output columns), so every device runs the same shapes.
* n < tp: each device holds one head, ``d·n // tp``; the devices sharing a head compute it alike and only the
  first of them feeds the output projection (the others' output columns are zero, so the sum counts it once).

Grouped heads (attention KV groups, GDN key heads, Mamba x/B groups) follow their heads: a device holds the
groups its heads read. When that is the same pattern on every device (the common case: groups divide evenly,
or one group per device, replicated when groups are fewer than devices) the groups keep their GQA layout;
otherwise each local head gets its own copy of its group (``expanded``), which is exact because a group's
projections and conv are computed per group.

Every head-structured tensor is rearranged so that device d's rows are one contiguous block of the sharded
axis: for GDN's flat ``[Q | K | V | Z]`` projection that means Q, K, V and Z are each split by heads and
regrouped per device (sharding the flat layout contiguously is the vLLM bug, spec §4). ``TensorShard.pieces``
says, for each device, which source rows make up its block; loaders read only those rows.

Plain Python and numpy; no device work here.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from .config import Apriel2Config, AttentionConfig, GDNConfig, KDAConfig, MambaConfig, StochasticConfig

AXIS = "tp"

# A device's block along the sharded axis: source row ranges (start, stop) and runs of zero rows (None, count).
Piece = tuple[int | None, int]


class ShardingError(ValueError):
    """The model cannot be split over the requested mesh (too few devices or vocabulary rows, a bad size)."""


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """n heads over tp devices: per device, the global head of each local slot (-1: a zero padding head) and
    whether the slot feeds the output projection."""

    count: int
    heads: tuple[tuple[int, ...], ...]
    primary: tuple[tuple[bool, ...], ...]

    @property
    def local(self) -> int:
        return len(self.heads[0])


def split_heads(n: int, tp: int) -> HeadSplit:
    if n >= tp:
        local = -(-n // tp)
        heads = tuple(tuple(h if h < n else -1 for h in range(d * local, (d + 1) * local)) for d in range(tp))
        primary = tuple(tuple(h >= 0 for h in row) for row in heads)
        return HeadSplit(n, heads, primary)
    heads = tuple((d * n // tp,) for d in range(tp))
    primary = tuple((d == 0 or heads[d] != heads[d - 1],) for d in range(tp))
    return HeadSplit(n, heads, primary)


def split_groups(heads: HeadSplit, groups: int) -> HeadSplit:
    """The groups each device's heads read (head h reads group h // (n / groups), repeat_interleave order):
    one local group per run of consecutive local heads when that pattern holds on every device, else one
    group copy per local head."""
    rep = heads.count // groups
    needed = [tuple(h // rep if h >= 0 else -1 for h in row) for row in heads.heads]
    distinct = max(len({g for g in row if g >= 0}) for row in needed)
    rows = None
    if heads.local % distinct == 0:
        rows = [_one_group_per_run(row, heads.local // distinct) for row in needed]
    if rows is None or any(row is None for row in rows):
        rows = needed
    return HeadSplit(groups, tuple(rows), tuple((True,) * len(row) for row in rows))


def _one_group_per_run(row: tuple[int, ...], per: int) -> tuple[int, ...] | None:
    picked = []
    for k in range(0, len(row), per):
        real = {g for g in row[k : k + per] if g >= 0}
        if len(real) > 1:
            return None
        picked.append(real.pop() if real else -1)
    return tuple(picked)


@dataclasses.dataclass(frozen=True)
class Segment:
    """``units`` blocks of ``block`` rows along the sharded axis; ``split`` says which units each device takes
    (None: the whole segment on every device). ``output``: rows of a non-primary slot are zeros."""

    block: int
    split: HeadSplit | None
    output: bool = False

    def pieces(self, offset: int, device: int) -> list[Piece]:
        if self.split is None:
            return [(offset, offset + self.block)]
        out = []
        for unit, primary in zip(self.split.heads[device], self.split.primary[device]):
            if unit < 0 or (self.output and not primary):
                out.append((None, self.block))
            else:
                out.append((offset + unit * self.block, offset + (unit + 1) * self.block))
        return out

    @property
    def source_rows(self) -> int:
        return self.block * (1 if self.split is None else self.split.count)


@dataclasses.dataclass(frozen=True)
class TensorShard:
    """How one checkpoint tensor is laid out over the mesh: split along ``axis`` (None: replicated)."""

    axis: int | None
    segments: tuple[Segment, ...] = ()

    def pieces(self, device: int) -> list[Piece]:
        """Device ``device``'s block along ``axis``, merged into as few ranges as possible."""
        out: list[Piece] = []
        offset = 0
        for segment in self.segments:
            for start, count in segment.pieces(offset, device):
                if out and start is not None and out[-1][0] is not None and out[-1][1] == start:
                    out[-1] = (out[-1][0], count)
                elif out and start is None and out[-1][0] is None:
                    out[-1] = (None, out[-1][1] + count)
                else:
                    out.append((start, count))
            offset += segment.source_rows
        return out

    def local_rows(self) -> int:
        return sum(_piece_rows(p) for p in self.pieces(0))


def _piece_rows(piece: Piece) -> int:
    start, end_or_count = piece
    return end_or_count if start is None else end_or_count - start


def read_shard(array: np.ndarray, shard: TensorShard, device: int) -> np.ndarray:
    """Device ``device``'s part of ``array`` (a memmap is fine: only its rows are read)."""
    if shard.axis is None:
        return np.asarray(array)
    axis = shard.axis
    parts = []
    for start, stop_or_count in shard.pieces(device):
        if start is None:
            shape = list(array.shape)
            shape[axis] = stop_or_count
            parts.append(np.zeros(shape, array.dtype))
        else:
            index = [slice(None)] * array.ndim
            index[axis] = slice(start, stop_or_count)
            parts.append(np.asarray(array[tuple(index)]))
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)


def replicated() -> TensorShard:
    return TensorShard(None)


def _rows(axis: int, *segments: Segment) -> TensorShard:
    return TensorShard(axis, tuple(segments))


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """The split of one model over ``tp`` devices: the per-device config and a ``TensorShard`` per checkpoint key.

    Keys not in ``tensors`` (norms, KDA's low-rank ``f_a``/``g_a`` projections, Mamba's ``dt_in_proj``, the biases
    of the output projections, which are added once after the sum) are replicated."""

    tp: int
    config: Apriel2Config  # the checkpoint's
    local_config: Apriel2Config  # what one device runs
    tensors: dict[str, TensorShard]

    def tensor(self, key: str) -> TensorShard:
        return self.tensors.get(key, replicated())


def _attention(cfg: AttentionConfig, tp: int):
    heads = split_heads(cfg.heads, tp)
    groups = split_groups(heads, cfg.head_groups)
    hd = cfg.head_size
    tensors = {
        "q_proj.weight": _rows(0, Segment(hd, heads)),
        "k_proj.weight": _rows(0, Segment(hd, groups)),
        "v_proj.weight": _rows(0, Segment(hd, groups)),
        "o_proj.weight": _rows(1, Segment(hd, heads, output=True)),
    }
    if cfg.q_bias:
        tensors["q_proj.bias"] = _rows(0, Segment(hd, heads))
    if cfg.k_bias:
        tensors["k_proj.bias"] = _rows(0, Segment(hd, groups))
    if cfg.v_bias:
        tensors["v_proj.bias"] = _rows(0, Segment(hd, groups))
    return dataclasses.replace(cfg, heads=heads.local, head_groups=groups.local), tensors


def _gdn(cfg: GDNConfig, tp: int):
    heads = split_heads(cfg.value_heads, tp)
    groups = split_groups(heads, cfg.key_heads)
    kd, vd = cfg.key_head_dim, cfg.value_head_dim
    q, k, v = Segment(kd, groups), Segment(kd, groups), Segment(vd, heads)
    tensors = {
        "in_proj_qkvz.weight": _rows(0, q, k, v, Segment(vd, heads)),
        "in_proj_ba.weight": _rows(0, Segment(1, heads), Segment(1, heads)),
        "convolution.weight": _rows(0, q, k, v),
        "out_proj.weight": _rows(1, Segment(vd, heads, output=True)),
        "dt_bias": _rows(0, Segment(1, heads)),
        "A_log": _rows(0, Segment(1, heads)),
    }
    return dataclasses.replace(cfg, value_heads=heads.local, key_heads=groups.local), tensors


def _kda(cfg: KDAConfig, tp: int):
    heads = split_heads(cfg.heads, tp)
    d = cfg.head_dim
    per_head = _rows(0, Segment(d, heads))
    tensors = {
        **{f"{name}.weight": per_head for name in ("q_proj", "k_proj", "v_proj", "q_conv", "k_conv", "v_conv")},
        "f_b_proj.weight": per_head,
        "g_b_proj.weight": per_head,
        "beta_proj.weight": _rows(0, Segment(1, heads)),
        "o_proj.weight": _rows(1, Segment(d, heads, output=True)),
        "A_log": _rows(0, Segment(1, heads)),
        "dt_bias": per_head,
    }
    return dataclasses.replace(cfg, heads=heads.local), tensors


def _mamba(cfg: MambaConfig, tp: int):
    n = cfg.state_size
    heads = split_heads(cfg.d_inner // n, tp)
    groups = split_groups(heads, cfg.d_xb // n)
    z, x, c = Segment(n, heads), Segment(n, groups), Segment(n, heads)
    in_proj = _rows(0, z, x, Segment(n, groups), c)
    per_channel = _rows(0, Segment(n, heads))
    conv = per_channel if cfg.repeat_kv_before_conv else _rows(0, Segment(n, groups))
    tensors = {
        "in_proj.weight": in_proj,
        "dt_proj.weight": per_channel,
        "conv1d.weight": conv,
        "A_log": per_channel,
        "D": per_channel,
        "out_proj.weight": _rows(1, Segment(n, heads, output=True)),
    }
    if cfg.add_linear_biases:
        tensors["in_proj.bias"] = in_proj
    if cfg.dt_proj_bias:
        tensors["dt_proj.bias"] = per_channel
    if cfg.conv_bias:
        tensors["conv1d.bias"] = conv
    return dataclasses.replace(cfg, d_inner=heads.local * n, d_xb=groups.local * n), tensors


_MIXERS = {AttentionConfig: _attention, GDNConfig: _gdn, KDAConfig: _kda, MambaConfig: _mamba}


def plan_tensor_parallel(config: Apriel2Config, tp: int) -> ShardPlan:
    """Split ``config``'s model over ``tp`` devices (any tp >= 1; see the module docstring for uneven counts)."""
    if not isinstance(tp, int) or tp < 1:
        raise ShardingError(f"tensor_parallel must be an integer >= 1, got {tp!r}")
    if config.vocab_size < tp:
        raise ShardingError(f"vocab_size {config.vocab_size} is smaller than tensor_parallel={tp}")
    tensors: dict[str, TensorShard] = {}
    blocks = []
    local_blocks: dict[int, object] = {}  # identical block configs share one local config
    for i, block in enumerate(config.blocks):
        prefix = f"model.decoder.blocks.{i}."
        if id(block) in local_blocks:
            local_block, block_tensors = local_blocks[id(block)]
        else:
            block_tensors = {}
            mixer = block.mixer
            if isinstance(mixer, StochasticConfig):
                subs = []
                for name, sub in mixer.mixers:
                    local_sub, sub_tensors = _MIXERS[type(sub)](sub, tp)
                    subs.append((name, local_sub))
                    block_tensors.update({f"mixer.mixers.{name}.{k}": v for k, v in sub_tensors.items()})
                local_mixer = dataclasses.replace(mixer, mixers=tuple(subs))
            else:
                local_mixer, mixer_tensors = _MIXERS[type(mixer)](mixer, tp)
                block_tensors.update({f"mixer.{k}": v for k, v in mixer_tensors.items()})
            mlp = block.mlp
            channels = split_heads(mlp.intermediate_size, tp)
            column = _rows(0, Segment(1, channels))
            block_tensors["mlp.up_proj.weight"] = column
            if mlp.gated:
                block_tensors["mlp.gate_proj.weight"] = column
            if mlp.up_bias:
                block_tensors["mlp.up_proj.bias"] = column
            block_tensors["mlp.down_proj.weight"] = _rows(1, Segment(1, channels, output=True))
            local_mlp = dataclasses.replace(mlp, intermediate_size=channels.local)
            local_block = dataclasses.replace(block, mixer=local_mixer, mlp=local_mlp)
            local_blocks[id(block)] = (local_block, block_tensors)
        blocks.append(local_block)
        tensors.update({prefix + k: v for k, v in block_tensors.items()})
    vocab = split_heads(config.vocab_size, tp)
    tensors["model.embed_tokens.weight"] = _rows(0, Segment(1, vocab))
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = _rows(0, Segment(1, vocab))
    local = dataclasses.replace(config, blocks=tuple(blocks), vocab_size=vocab.local)
    return ShardPlan(tp, config, local, tensors)


def cache_axis(name: str) -> int:
    """The axis of a cache leaf that holds heads or channels (split over the mesh like its mixer's heads):
    attention pages [pages, page, groups, head], conv states [slots, taps, channels], recurrent states
    [slots, heads, ...]."""
    if name in ("k", "v") or name.startswith("conv"):
        return 2
    if name == "ssm":
        return 1
    raise ValueError(f"unknown cache array {name!r}")


def make_mesh(tp: int, devices: Sequence | None = None):
    """A one-axis mesh (``AXIS``) over the first ``tp`` of ``devices`` (default: ``jax.devices()``). Multi-host:
    call ``apriel2_jax.distributed.initialize`` first, then ``jax.devices()`` lists every host's devices and the
    mesh spans them."""
    import jax
    from jax.sharding import Mesh

    devices = list(jax.devices() if devices is None else devices)
    if tp > len(devices):
        raise ShardingError(
            f"tensor_parallel={tp} needs {tp} devices, but {len(devices)} are visible "
            f"({devices[0].platform if devices else 'none'}); on a CPU use "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tp} for virtual devices; across hosts, join the "
            f"processes first (apriel2_jax.distributed.initialize)"
        )
    owners = {device.process_index for device in devices[:tp]}
    if len(owners) < jax.process_count():
        # A joined process with no device in the mesh would wait forever in the others' collectives.
        raise ShardingError(
            f"tensor_parallel={tp} takes the devices of process(es) {sorted(owners)} only, but {jax.process_count()} "
            f"processes are joined and each must hold a share of the mesh: use tensor_parallel={len(devices)} "
            f"(every device) or fewer processes"
        )
    return Mesh(np.asarray(devices[:tp]), (AXIS,))


__all__ = [
    "AXIS",
    "HeadSplit",
    "ShardPlan",
    "ShardingError",
    "TensorShard",
    "cache_axis",
    "make_mesh",
    "plan_tensor_parallel",
    "read_shard",
    "split_groups",
    "split_heads",
]
