"""A model split over a one-axis device mesh, and running it.

The parameters are global ``jax.Array``s in the mesh layout of ``apriel2_jax.sharding`` (device d's rows are
block d of the sharded axis), each placed straight onto its ``NamedSharding``. Computation runs inside
``jax.shard_map``: every device merges its local blocks into the *per-device* module (the model built from the
plan's local config, its output projections marked to sum over the mesh axis and its vocabulary split), so the
Pallas kernels see ordinary local shapes and the only collectives are the explicit ones: one all-reduce after
each mixer and each MLP, one for the embedding, one all-gather of the logits.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import Apriel2Config
from .modules import Apriel2ForCausalLM, checkpoint_key as _key
from .modules.attention import Attention
from .modules.gdn import GatedDeltaNet
from .modules.kda import KimiDeltaAttention
from .modules.mamba import Mamba
from .modules.mlp import MLP
from .placement import Placement
from .sharding import AXIS, ShardPlan, cache_axis, make_mesh, plan_tensor_parallel, read_shard


def _spec(axis: int | None) -> P:
    return P() if axis is None else P(*([None] * axis), AXIS)


def mark_parallel(model: Apriel2ForCausalLM, axis: str = AXIS) -> None:
    """Turn a per-device model into its tensor-parallel form: output projections sum over ``axis``, the embedding
    and LM head are vocabulary-split."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, Attention | KimiDeltaAttention):
            module.o_proj.reduce_axis = axis
        elif isinstance(module, GatedDeltaNet | Mamba):
            module.out_proj.reduce_axis = axis
        elif isinstance(module, MLP):
            module.down_proj.reduce_axis = axis
    model.model.embed_tokens.vocab_axis = axis
    model.vocab_axis = axis


class ShardedModel:
    """A model over ``mesh``: what the engine's step and :meth:`forward` run inside ``shard_map``.

    ``param_leaves`` follow ``param_tree`` (the flat order of the per-device model's state); ``param_specs``
    give each leaf's ``PartitionSpec``; ``keys`` its checkpoint key."""

    def __init__(self, plan: ShardPlan, mesh: Mesh, dtype, make_leaf: Callable[[str, jax.ShapeDtypeStruct, NamedSharding], jax.Array]):
        if mesh.shape != {AXIS: plan.tp}:
            raise ValueError(f"the mesh must have one axis {AXIS!r} of size {plan.tp}, got {dict(mesh.shape)}")
        self.plan, self.mesh, self.dtype = plan, mesh, dtype
        self.config: Apriel2Config = plan.config
        self.local_config: Apriel2Config = plan.local_config
        abstract = _abstract_local(plan, dtype)
        layout = parameter_layout(plan, mesh, dtype, abstract)
        abstract.vocab_size = plan.config.vocab_size
        mark_parallel(abstract)
        self.graphdef, state = nnx.split(abstract)
        flat = list(nnx.to_flat_state(state))
        specs = {}
        for path, var in flat:
            key = _key(path)
            struct = layout[key]
            specs[key] = struct.sharding.spec
            var.set_value(make_leaf(key, jax.ShapeDtypeStruct(struct.shape, struct.dtype), struct.sharding))
        self.param_leaves, self.param_tree = jax.tree.flatten(state)
        by_id = {id(var.get_value()): _key(path) for path, var in flat}
        self.keys = [by_id[id(leaf)] for leaf in self.param_leaves]
        self.param_specs = [specs[key] for key in self.keys]
        self._compiled: dict = {}

    # ------------------------------------------------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return self.plan.tp

    def local_model(self, param_leaves) -> Apriel2ForCausalLM:
        """Inside ``shard_map``: this device's module over its blocks of the parameters."""
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.param_tree, param_leaves))

    def cache_specs(self, cache) -> tuple[P, ...]:
        """The ``PartitionSpec`` of each leaf of an engine or dense cache (tuple of per-layer dicts)."""
        return tuple(_spec(cache_axis(str(path[-1].key))) for path, _ in jax.tree_util.tree_flatten_with_path(cache)[0])

    def init_paged_cache(self, placement: Placement, pages: dict[str, int], page_size: int, slots: int):
        """Empty engine caches, each device holding its heads' share (zeros, created in place)."""
        local_model = _abstract_local(self.plan, self.dtype)  # the caches' per-device shapes
        local = jax.eval_shape(lambda: local_model.init_paged_cache(placement, pages, page_size, slots))
        specs = self.cache_specs(local)
        leaves, tree = jax.tree.flatten(local)
        out = []
        for leaf, spec in zip(leaves, specs):
            shape = list(leaf.shape)
            shape[len(spec) - 1] *= self.tp
            sharding = NamedSharding(self.mesh, spec)
            out.append(jax.jit(lambda s=tuple(shape), d=leaf.dtype: jnp.zeros(s, d), out_shardings=sharding)())
        return jax.tree.unflatten(tree, out)

    def shard_map(self, fn, in_specs, out_specs):
        """``fn(local_model, *args)`` over the mesh; the parameters go in first."""
        def body(param_leaves, *args):
            return fn(self.local_model(param_leaves), *args)

        return jax.shard_map(
            body, mesh=self.mesh, in_specs=(self.param_specs, *in_specs), out_specs=out_specs, check_vma=False
        )

    def forward(self, input_ids, placement: Placement) -> jax.Array:
        """Full-sequence logits [B, T, V] (replicated), as ``Apriel2ForCausalLM.__call__`` without a cache."""
        key = ("forward", placement)
        if key not in self._compiled:
            run = self.shard_map(lambda model, ids: model(ids, placement)[0], (P(),), P())
            self._compiled[key] = jax.jit(run)
        return self._compiled[key](self.param_leaves, jnp.asarray(input_ids, jnp.int32))


def _abstract_local(plan: ShardPlan, dtype) -> Apriel2ForCausalLM:
    """The per-device model, shapes only."""
    return nnx.eval_shape(lambda: Apriel2ForCausalLM(plan.local_config, dtype=dtype, rngs=nnx.Rngs(0)))


def parameter_layout(plan: ShardPlan, mesh: Mesh, dtype, abstract: Apriel2ForCausalLM | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """Every parameter's global shape, dtype and ``NamedSharding`` over ``mesh`` (checkpoint key order);
    ``abstract``: the per-device model when the caller has built it already."""
    if abstract is None:
        abstract = _abstract_local(plan, dtype)
    layout = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract)):
        key = _key(path)
        shard = plan.tensor(key)
        local = var.get_value()
        shape = list(local.shape)
        if shard.axis is not None:
            if shard.local_rows() != shape[shard.axis]:
                raise RuntimeError(f"{key}: the shard plan gives {shard.local_rows()} rows per device, the "
                                   f"per-device model has {shape[shard.axis]}")
            shape[shard.axis] *= plan.tp
        layout[key] = jax.ShapeDtypeStruct(tuple(shape), local.dtype, sharding=NamedSharding(mesh, _spec(shard.axis)))
    return layout


def shard_model(model: Apriel2ForCausalLM, mesh: Mesh | int) -> ShardedModel:
    """Split an in-memory model over ``mesh`` (or a new mesh of that many devices); each device's rows are cut from
    the host copy of the parameters."""
    if isinstance(mesh, int):
        mesh = make_mesh(mesh)
    plan = plan_tensor_parallel(model.config, mesh.shape[AXIS])
    source = {_key(path): var for path, var in nnx.to_flat_state(nnx.state(model))}
    return ShardedModel(plan, mesh, model.dtype, lambda key, struct, sharding: place(
        np.asarray(source[key].get_value()), plan, key, struct, sharding
    ))


def place(host: np.ndarray, plan: ShardPlan, key: str, struct: jax.ShapeDtypeStruct, sharding: NamedSharding) -> jax.Array:
    """A global array of ``struct`` from ``host`` (a checkpoint tensor, memmap allowed): each addressable device
    gets only its own rows, cast to the model dtype."""
    shard = plan.tensor(key)
    local_rows = None if shard.axis is None else struct.shape[shard.axis] // plan.tp

    def device_block(index):
        device = 0 if shard.axis is None else (index[shard.axis].start or 0) // local_rows
        block = read_shard(host, shard, device)
        return block if block.dtype == struct.dtype else block.astype(struct.dtype)

    return jax.make_array_from_callback(struct.shape, sharding, device_block)


def random_sharded(config: Apriel2Config, mesh: Mesh | int, dtype=jnp.bfloat16, seed: int = 0) -> ShardedModel:
    """Random weights for benchmarks, created on the devices at their per-device shapes (no full copy anywhere;
    devices sharing a head do not hold equal values, which a benchmark does not care about)."""
    if isinstance(mesh, int):
        mesh = make_mesh(mesh)
    plan = plan_tensor_parallel(config, mesh.shape[AXIS])

    # One device's worth, built eagerly on device 0 (jitting the whole initialisation compiles for minutes at
    # 15B); each device gets a copy of its local block.
    local = Apriel2ForCausalLM(plan.local_config, dtype=dtype, rngs=nnx.Rngs(seed))
    values = {_key(path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(local))}
    del local

    def make(key, struct, sharding):
        block = values.pop(key)
        return jax.make_array_from_single_device_arrays(
            struct.shape, sharding, [jax.device_put(block, d) for d in sharding.addressable_devices_indices_map(struct.shape)]
        )

    model = ShardedModel(plan, mesh, dtype, make)
    del values
    return model


__all__ = ["ShardedModel", "mark_parallel", "place", "random_sharded", "shard_model"]
