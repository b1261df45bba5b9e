"""A float32 model's matmuls run at HIGHEST precision whatever ``jax_default_matmul_precision`` says (on GPUs the
default is TF32); other dtypes keep the caller's default. Checked on traced jaxprs: every dot_general asks for
HIGHEST exactly when its operands are float32."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from apriel2_jax.ops import decode_fused
from apriel2_jax.ops.precision import einsum, matmul_precision

HIGHEST = jax.lax.Precision.HIGHEST


def _dots(closed) -> list:
    """(precision, operand dtypes) of every dot_general in a closed jaxpr, sub-jaxprs (jit, loops, conds) included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append((eqn.params["precision"], tuple(jnp.dtype(v.aval.dtype) for v in eqn.invars)))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)

    walk(closed.jaxpr)
    return found


def _is_highest(precision) -> bool:
    return precision is not None and all(p == HIGHEST for p in (precision if isinstance(precision, tuple)
                                                                 else (precision,)))


def _check(closed, expect_float32: bool):
    """Every dot asks for HIGHEST exactly when its operands are float32; the model's dtype shows in its dots."""
    dots = _dots(closed)
    assert dots
    for precision, dtypes in dots:
        assert _is_highest(precision) == all(d == jnp.float32 for d in dtypes), (precision, dtypes)
    assert any(all(d == jnp.float32 for d in dtypes) for _, dtypes in dots) or not expect_float32
    return dots


def test_matmul_precision_by_dtype():
    f32, bf16 = jnp.ones((2, 2), jnp.float32), jnp.ones((2, 2), jnp.bfloat16)
    assert matmul_precision(f32, f32) == HIGHEST
    assert matmul_precision(bf16, bf16) is None
    assert matmul_precision(bf16, f32) is None
    with jax.default_matmul_precision("tensorfloat32"):
        _check(jax.make_jaxpr(lambda a, b: einsum("ij,kj->ik", a, b))(f32, f32), True)


# hybrid_all_mixers: attention, sliding window, GDN, KDA and Mamba layers, an untied LM head; supernet_fixed: a
# tied one (the embedding table as the LM head's weight).
@pytest.mark.parametrize("case_name", ["hybrid_all_mixers", "supernet_fixed"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_forward_and_cached_step(case_name, dtype):
    from apriel2_jax.checkpoint import load_model
    from apriel2_jax.parity import load_case
    from apriel2_jax.placement import resolve_placement
    from apriel2_jax.runner import ModelRunner
    from tests.conftest import GOLDENS

    directory = f"{GOLDENS}/{case_name}"
    case = load_case(directory)
    runner = ModelRunner(load_model(directory, dtype))
    placement = resolve_placement(runner.config, case.placements[next(iter(case.placements))])
    ids = jnp.zeros((2, 5), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    with jax.default_matmul_precision("tensorfloat32"):
        full = runner._forward.trace(runner.params, ids, None, None, placement=placement).jaxpr
        cache = runner.init_cache(2, 8, placement)
        step = runner._step.trace(runner.params, ids, positions, cache, placement=placement).jaxpr
    for closed in (full, step):
        dots = _check(closed, dtype == "float32")
        if dtype == "bfloat16":  # the projections, attention and LM head at the default
            assert sum(not _is_highest(p) for p, _ in dots) >= 10


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_recurrent_mixers_engine_decode(name):
    """The engine's decode of GDN and KDA (KDA's low-rank gate projections run only there), in float32."""
    from apriel2_jax.modules.mixers import build_leaf_mixer
    from apriel2_jax.modules.paged import PagedBatch
    from tests.modules.test_mixers import CONFIG, MIXERS

    mixer = build_leaf_mixer(MIXERS[name], CONFIG.hidden_size, dtype=jnp.float32, rngs=nnx.Rngs(3))
    pool = mixer.init_state(3, 1, jnp.float32)
    batch = PagedBatch(
        positions=jnp.asarray([[4], [0]], jnp.int32), token_mask=jnp.ones((2, 1), bool),
        last_index=jnp.zeros((2,), jnp.int32), slots=jnp.asarray([2, 1], jnp.int32),
        fresh=jnp.asarray([False, True]), tables={}, first_page={},
    )
    x = jnp.ones((2, 1, CONFIG.hidden_size), jnp.float32)
    graphdef, state = nnx.split(mixer)
    with jax.default_matmul_precision("tensorfloat32"):
        closed = jax.make_jaxpr(lambda s, x, p: nnx.merge(graphdef, s).paged_decode(x, batch, p))(state, x, pool)
    _check(closed, True)


def test_decode_chains():
    """The oracles of the decode GEMV kernels, which run in XLA where no kernel takes the shapes."""
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    x, norm, w1, w2, residual = f(2, 8), f(8), f(6, 8), f(4, 8), f(2, 6)
    with jax.default_matmul_precision("tensorfloat32"):
        projections = jax.make_jaxpr(lambda *a: decode_fused.norm_projections(a[0], a[1], 1e-5, (a[2], a[3])))(
            x, norm, w1, w2)
        added = jax.make_jaxpr(decode_fused.matmul_add)(x, w1, residual)
    for closed in (projections, added):
        _check(closed, True)
