"""Pallas GPU kernels (later issues). Each implements the signature of an ``apriel2_jax.ops`` function."""
