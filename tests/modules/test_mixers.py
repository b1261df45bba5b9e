"""Every mixer module: a prefill split into pieces (1, 3, 7, rest; single tokens take the step path) gives the
same outputs and final state as one pass, and the whole model agrees with its full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from apriel2_jax.config import parse_config
from apriel2_jax.modules.mixers import build_leaf_mixer
from apriel2_jax.placement import resolve_placement
from apriel2_jax.runner import ModelRunner
from tests.helpers import random_weights, tiny_config, write_checkpoint
from tests.ops.util import RTOL, rel_err, split_points

CONFIG = parse_config(tiny_config())
MIXERS = {
    "attention": CONFIG.blocks[0].mixer,
    "gdn": CONFIG.blocks[1].mixer,
    "kda": CONFIG.blocks[2].mixer,
    "sliding_window": CONFIG.blocks[3].mixer,
    "mamba": CONFIG.blocks[4].mixer,
}


@nnx.jit
def _call(mixer, x, pos, state):
    return mixer(x, pos, state)


def _run_pieces(mixer, x, pieces):
    batch, length, _ = x.shape
    state = mixer.init_state(batch, length, jnp.float32)
    bounds = split_points(length, pieces)
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        pos = jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (batch, b - a))
        y, state = _call(mixer, x[:, a:b], pos, state)
        outs.append(y)
    return jnp.concatenate(outs, 1), state


@pytest.mark.parametrize("name", MIXERS)
def test_mixer_prefill_in_pieces_equals_one_pass(name):
    mixer = build_leaf_mixer(MIXERS[name], CONFIG.hidden_size, dtype=jnp.float32, rngs=nnx.Rngs(7))
    x = jax.random.normal(jax.random.key(1), (2, 17, CONFIG.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(17, dtype=jnp.int32), (2, 17))
    full, _ = _call(mixer, x, pos, None)
    whole, whole_state = _run_pieces(mixer, x, ())
    pieces, piece_state = _run_pieces(mixer, x, (1, 3, 7))
    singles, single_state = _run_pieces(mixer, x, (1,) * 16)
    for out in (whole, pieces, singles):
        assert rel_err(out, full) <= RTOL
    for state in (piece_state, single_state):
        for key in whole_state:
            assert rel_err(state[key], whole_state[key]) <= RTOL, key


@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory):
    config = tiny_config()
    directory = write_checkpoint(str(tmp_path_factory.mktemp("tiny")), config, random_weights(config, seed=11))
    from apriel2_jax.checkpoint import load_model

    return ModelRunner(load_model(directory))


@pytest.mark.parametrize("choice", ["attention", "gdn"])
def test_model_chunked_prefill_and_decode_match_full_forward(tiny_runner, choice):
    placement = resolve_placement(tiny_runner.config, {"5": choice})
    ids = np.random.default_rng(0).integers(0, 64, (2, 15)).astype(np.int32)
    full = np.asarray(tiny_runner.forward(ids, placement))
    cache = tiny_runner.init_cache(2, 15, placement)
    outs = []
    for a, b in zip([0, 3, 10, 11, 12, 13, 14], [3, 10, 11, 12, 13, 14, 15]):
        logits, cache = tiny_runner.extend(ids[:, a:b], a, cache, placement)
        outs.append(np.asarray(logits))
    assert rel_err(np.concatenate(outs, 1), full) <= 1e-4


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_fused_decode_kernel_wiring_matches_the_unfused_path(name):
    """With the fused decode kernel registered (interpret mode, on CPU for the test) the module's engine decode
    gives what the unfused chain of ops gives, and updates the same slots of the conv and state pools."""
    from apriel2_jax import dispatch
    from apriel2_jax.modules.paged import PagedBatch
    from pallas_kernels import delta_rule_decode_fused

    mixer = build_leaf_mixer(MIXERS[name], CONFIG.hidden_size, dtype=jnp.float32, rngs=nnx.Rngs(3))
    rows, slots_total = 2, 5
    rng = np.random.default_rng(0)
    pool = {k: jnp.asarray(rng.standard_normal(v.shape), v.dtype)
            for k, v in mixer.init_state(slots_total, 1, jnp.float32).items()}
    batch = PagedBatch(
        positions=jnp.asarray([[9], [0]], jnp.int32), token_mask=jnp.ones((rows, 1), bool),
        last_index=jnp.zeros((rows,), jnp.int32), slots=jnp.asarray([3, 1], jnp.int32),
        fresh=jnp.asarray([False, True]), tables={}, first_page={},
    )
    x = jax.random.normal(jax.random.key(2), (rows, 1, CONFIG.hidden_size))
    op_name = f"{name}_decode_fused_slots"
    assert dispatch.kernel(op_name) is None  # not registered on CPU: the unfused path
    y_ref, pool_ref = mixer.paged_decode(x, batch, pool)
    kernel_fn = getattr(delta_rule_decode_fused, f"{name}_decode_fused")
    calls = []

    def fused(*args, **kwargs):
        calls.append(1)
        return kernel_fn(*args, **kwargs, interpret=True, block_v=8)

    dispatch.register(op_name, "cpu", fused)
    try:
        y, new_pool = mixer.paged_decode(x, batch, pool)
    finally:
        dispatch._KERNELS.pop((op_name, "cpu"))
    assert calls, "the module did not take the fused path"
    assert rel_err(y, y_ref) <= 1e-5
    for key in pool_ref:
        assert rel_err(new_pool[key], pool_ref[key]) <= 1e-5, key
