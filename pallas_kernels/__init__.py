"""Pallas GPU kernels. Each implements the signature of an ``apriel2_jax.ops`` function and is registered with
the dispatch point for the GPU backend; ``apriel2_jax.dispatch`` imports this package on first use off CPU."""

from apriel2_jax import dispatch

from . import delta_rule_decode


def register_all() -> None:
    dispatch.register("delta_rule_decode_slots", "gpu", delta_rule_decode.decode_slots)


register_all()
