"""Loading an HF Apriel2 checkpoint directory into the Flax model.

The parameter tree mirrors the HF key paths, so the expected key set comes from the model's own abstract
state (``nnx.eval_shape``: no memory is allocated for it). Every problem (missing, unexpected, mis-shaped
tensors) is collected and reported in one error. Tensors are then read one at a time from memory maps, cast,
and put on the device, so the host never holds a second full copy of the model.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from .config import Apriel2Config, load_config
from .modules import Apriel2ForCausalLM, checkpoint_key as _key
from .orbax_checkpoint import is_converted, read_manifest, restore_tensors
from .safetensors_io import CheckpointError, TensorInfo, index_checkpoint, read_tensor
from .sharding import AXIS, make_mesh, plan_tensor_parallel
from .tensor_parallel import ShardedModel, parameter_layout, place

__all__ = ["CheckpointError", "check_tensors", "load_model", "expected_parameters", "DTYPES"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")

# Keys a text-only model ignores on purpose: the multimodal wrapper's vision tower (spec Appendix B).
_IGNORED_PREFIXES = ("model.vision_encoder.",)


def expected_parameters(config: Apriel2Config, dtype=jnp.float32) -> tuple[nnx.GraphDef, nnx.State, dict]:
    """Graph definition, abstract state, and {HF key: abstract variable} of the model for ``config``."""
    abstract = nnx.eval_shape(lambda: Apriel2ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    return graphdef, state, {_key(path): var for path, var in nnx.to_flat_state(state)}


def check_tensors(directory: str, config: Apriel2Config, found: dict[str, TensorInfo], expected: dict) -> None:
    """Every problem of a safetensors checkpoint against the model of ``config`` in one error: missing,
    unexpected and mis-shaped tensors (with their files), and tensors that are not floating point."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(
        f"{k} (in {os.path.basename(found[k].file)})"
        for k in set(found) - set(expected)
        if not k.startswith(_IGNORED_PREFIXES) and not (k == "lm_head.weight" and config.tie_word_embeddings)
    )
    mismatched = sorted(
        f"{k} (in {os.path.basename(found[k].file)}): checkpoint {list(found[k].shape)}, model expects "
        f"{list(expected[k].shape)}"
        for k in set(found) & set(expected)
        if tuple(found[k].shape) != tuple(expected[k].shape)
    )
    not_float = sorted(
        f"{k} (in {os.path.basename(found[k].file)}): {found[k].dtype}, expected a floating-point tensor"
        for k in set(found) & set(expected)
        if np.dtype(found[k].dtype).name not in _FLOAT_DTYPES
    )
    if missing or unexpected or mismatched or not_float:
        lines = [f"checkpoint {directory} does not match its config.json:"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", mismatched),
                             ("wrong dtype", not_float)):
            if items:
                lines.append(f"  {title} ({len(items)}):")
                lines.extend(f"    {item}" for item in items)
        raise CheckpointError("\n".join(lines))


def load_model(
    directory: str | os.PathLike,
    dtype: str | jnp.dtype = "float32",
    progress: Callable[[int, int, str], None] | None = None,
    *,
    tensor_parallel: int | Mesh = 1,
) -> Apriel2ForCausalLM | ShardedModel:
    """Load ``config.json`` and the weights of ``directory`` as a model in ``dtype``: an HF checkpoint (single or
    sharded safetensors) or one written by ``apriel2-convert`` (orbax, ``apriel2_jax.orbax_checkpoint``).

    Parameters the reference keeps in fp32 (gates' ``A_log``/``dt_bias``, Mamba ``D``) stay fp32.
    ``progress(done, total, key)`` is called as tensors arrive; by default a line is printed to stderr for
    checkpoints large enough to take a while.

    ``tensor_parallel``: a device count (a one-axis mesh over the first devices) or a ``Mesh`` with one axis
    ``"tp"``; the result is then a :class:`ShardedModel` whose every tensor goes straight onto its
    ``NamedSharding``, each device reading only its own rows (from the memory-mapped safetensors, or from the
    orbax checkpoint when it was converted for this mesh size).
    """
    directory = os.fspath(directory)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    config = load_config(directory)
    mesh = None
    if isinstance(tensor_parallel, Mesh) or tensor_parallel != 1:
        mesh = tensor_parallel if isinstance(tensor_parallel, Mesh) else make_mesh(tensor_parallel)
    if is_converted(directory):
        return _load_converted(directory, config, dtype, mesh, progress)

    graphdef, state, expected = expected_parameters(config, dtype)
    found = index_checkpoint(directory)
    check_tensors(directory, config, found, expected)
    total = len(expected)
    nbytes = sum(int(np.prod(found[k].shape)) * found[k].dtype.itemsize for k in expected)
    if progress is None and nbytes > 2**30:
        progress = _stderr_progress(nbytes)
    if mesh is not None:
        plan = plan_tensor_parallel(config, mesh.shape[AXIS])
        loaded = [0]

        def make(key, struct, sharding):
            array = place(read_tensor(found[key]), plan, key, struct, sharding)
            loaded[0] += 1
            if progress is not None:
                progress(loaded[0], total, key)
            return array

        return ShardedModel(plan, mesh, dtype, make)
    for done, (path, var) in enumerate(nnx.to_flat_state(state), start=1):
        key = _key(path)
        array = read_tensor(found[key])
        target = var.dtype
        host = np.asarray(array) if array.dtype == target else np.asarray(array).astype(target)
        var.set_value(jax.device_put(host))
        if progress is not None:
            progress(done, total, key)
    return nnx.merge(graphdef, state)


def _load_converted(directory: str, config: Apriel2Config, dtype, mesh: Mesh | None, progress):
    stored_tp = read_manifest(directory)["tensor_parallel"]
    tp = 1 if mesh is None else mesh.shape[AXIS]
    if mesh is None or (stored_tp == 1 and tp > 1):
        graphdef, state, expected = expected_parameters(config, dtype)
        if stored_tp != 1:
            raise CheckpointError(
                f"{directory} was converted for tensor_parallel={stored_tp}: load it with tensor_parallel="
                f"{stored_tp}, or convert the HF checkpoint again with --tp 1 (which loads at any size)"
            )
        # One-device layout: restore onto the default device, or onto the host when it is split further below.
        device = jax.devices()[0] if mesh is None else jax.devices("cpu")[0]
        targets = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=SingleDeviceSharding(device)) for k, v in expected.items()}
        arrays = restore_tensors(directory, targets, progress)
        if mesh is None:
            for path, var in nnx.to_flat_state(state):
                var.set_value(arrays[_key(path)])
            return nnx.merge(graphdef, state)
        plan = plan_tensor_parallel(config, tp)
        return ShardedModel(plan, mesh, dtype, lambda key, struct, sharding: place(
            np.asarray(arrays.pop(key)), plan, key, struct, sharding))
    if stored_tp != tp:
        raise CheckpointError(
            f"{directory} was converted for tensor_parallel={stored_tp}, not {tp}: load it with tensor_parallel="
            f"{stored_tp}, convert again with --tp {tp}, or load the HF checkpoint"
        )
    plan = plan_tensor_parallel(config, tp)
    arrays = restore_tensors(directory, parameter_layout(plan, mesh, dtype), progress)
    return ShardedModel(plan, mesh, dtype, lambda key, struct, sharding: arrays.pop(key))


def _stderr_progress(nbytes: int) -> Callable[[int, int, str], None]:
    start = time.monotonic()
    last = [0.0]

    def report(done: int, total: int, key: str) -> None:
        now = time.monotonic()
        if now - last[0] > 1.0 or done == total:
            last[0] = now
            print(
                f"\rloading weights: {done}/{total} tensors ({nbytes / 2**30:.1f} GiB) {now - start:.0f}s",
                end="\n" if done == total else "",
                file=sys.stderr,
                flush=True,
            )

    return report
