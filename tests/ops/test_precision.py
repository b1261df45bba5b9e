"""A float32 model's matmuls run at HIGHEST precision whatever ``jax_default_matmul_precision`` says (on GPUs the
default is TF32); other dtypes keep XLA's default."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from apriel2_jax.ops import decode_fused
from apriel2_jax.ops.precision import einsum, matmul_precision

HIGHEST = jax.lax.Precision.HIGHEST


def _dot_precisions(closed) -> list:
    """The precision of every dot_general in a closed jaxpr, sub-jaxprs (jit, loops, conds) included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(eqn.params["precision"])
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(closed.jaxpr)
    return found


def _is_highest(precision) -> bool:
    return precision is not None and all(p == HIGHEST for p in (precision if isinstance(precision, tuple)
                                                                 else (precision,)))


def test_matmul_precision_by_dtype():
    f32, bf16 = jnp.ones((2, 2), jnp.float32), jnp.ones((2, 2), jnp.bfloat16)
    assert matmul_precision(f32, f32) == HIGHEST
    assert matmul_precision(bf16, bf16) is None
    assert matmul_precision(bf16, f32) is None
    precisions = _dot_precisions(jax.make_jaxpr(lambda a, b: einsum("ij,kj->ik", a, b))(f32, f32))
    assert len(precisions) == 1 and _is_highest(precisions[0])


@pytest.fixture(scope="module")
def hybrid_f32():
    from tests.helpers import golden_model

    case, model, _ = golden_model("hybrid_all_mixers")
    return case, model


def test_float32_model_forward_and_cached_steps_ask_for_highest(hybrid_f32):
    """Attention, GDN, KDA and Mamba layers, the MLPs and the LM head: full forward and a cached prefill, traced
    under the lowest default precision."""
    from apriel2_jax.placement import resolve_placement
    from apriel2_jax.runner import ModelRunner

    case, model = hybrid_f32
    runner = ModelRunner(model)
    placement = resolve_placement(model.config, case.placements[next(iter(case.placements))])
    ids = jnp.zeros((2, 5), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    with jax.default_matmul_precision("bfloat16"):
        full = runner._forward.trace(runner.params, ids, None, None, placement=placement).jaxpr
        cache = runner.init_cache(2, 8, placement)
        step = runner._step.trace(runner.params, ids, positions, cache, placement=placement).jaxpr
    for closed in (full, step):
        precisions = _dot_precisions(closed)
        assert len(precisions) >= 10
        assert all(_is_highest(p) for p in precisions), precisions


def test_bfloat16_model_projections_keep_the_default(hybrid_f32):
    """The projections and the attention of a bfloat16 model stay at XLA's default (the tensor cores)."""
    from apriel2_jax.checkpoint import load_model
    from apriel2_jax.placement import resolve_placement
    from apriel2_jax.runner import ModelRunner
    from tests.conftest import GOLDENS

    case = hybrid_f32[0]
    runner = ModelRunner(load_model(f"{GOLDENS}/hybrid_all_mixers", "bfloat16"))
    placement = resolve_placement(runner.config, case.placements[next(iter(case.placements))])
    full = runner._forward.trace(runner.params, jnp.zeros((2, 5), jnp.int32), None, None, placement=placement).jaxpr
    precisions = _dot_precisions(full)
    # Every Linear (Q/K/V, output, MLP, LM head) at the default; the delta rule's own products ask for HIGHEST.
    assert sum(p is None for p in precisions) >= 10, precisions


def test_decode_chains_ask_for_highest_in_float32():
    """The oracles of the decode kernels, which run in XLA where no kernel takes the shapes."""
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    x, norm, w1, w2, residual = f(2, 8), f(8), f(6, 8), f(4, 8), f(2, 6)
    with jax.default_matmul_precision("bfloat16"):
        projections = jax.make_jaxpr(lambda *a: decode_fused.norm_projections(a[0], a[1], 1e-5, (a[2], a[3])))(
            x, norm, w1, w2)
        added = jax.make_jaxpr(decode_fused.matmul_add)(x, w1, residual)
    for closed in (projections, added):
        precisions = _dot_precisions(closed)
        assert precisions and all(_is_highest(p) for p in precisions), precisions
