"""Memory-mapped reading of (possibly sharded) safetensors checkpoints, one tensor at a time.

The format is an 8-byte little-endian header length, a JSON header of {name: {dtype, shape, data_offsets}},
then raw little-endian data. Reading it directly gives numpy memmaps for every dtype, bfloat16 included (via
ml_dtypes), with no framework in between and no second copy of the model on the host.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensor infos and ``__metadata__`` of one safetensors file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (size,) = struct.unpack("<Q", raw)
            if size > 100 * 2**20:
                raise CheckpointError(f"{path}: header claims {size} bytes; not a safetensors file?")
            header = json.loads(f.read(size))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read safetensors header ({err})") from None
    file_size = os.path.getsize(path)
    metadata = header.pop("__metadata__", None) or {}
    infos = {}
    for name, entry in header.items():
        if entry.get("dtype") not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {entry.get('dtype')!r}")
        dtype = np.dtype(_DTYPES[entry["dtype"]])
        shape = tuple(int(d) for d in entry["shape"])
        start, end = entry["data_offsets"]
        if end - start != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or 8 + size + end > file_size:
            raise CheckpointError(f"{path}: tensor {name} has inconsistent offsets (truncated file?)")
        infos[name] = TensorInfo(path, dtype, shape, 8 + size + start)
    return infos, metadata


def read_tensor(info: TensorInfo) -> np.ndarray:
    """A read-only memmap of one tensor (no data is read until it is used)."""
    if not info.shape or 0 in info.shape:
        return np.zeros(info.shape, info.dtype)
    return np.memmap(info.file, dtype=info.dtype, mode="r", offset=info.offset, shape=info.shape)


def index_checkpoint(directory: str) -> dict[str, TensorInfo]:
    """All tensors of a checkpoint directory: ``model.safetensors`` or shards listed in the index file."""
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index ({err!r})") from None
        infos: dict[str, TensorInfo] = {}
        for shard in sorted(set(weight_map.values())):
            path = os.path.join(directory, shard)
            if not os.path.exists(path):
                raise CheckpointError(f"{index} lists shard {shard}, which is not in {directory}")
            shard_infos, _ = read_header(path)
            for name, info in shard_infos.items():
                if weight_map.get(name) == shard:
                    infos[name] = info
        absent = sorted(set(weight_map) - set(infos))
        if absent:
            raise CheckpointError(f"{index} maps tensors to shards that do not hold them: {absent[:10]}")
        return infos
    if os.path.exists(single):
        return read_header(single)[0]
    raise CheckpointError(
        f"no model.safetensors or model.safetensors.index.json in {directory}: expected an HF checkpoint directory"
    )
