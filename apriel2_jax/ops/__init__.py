"""Each mixer's math as pure jnp functions with explicit state: the oracle for kernels and the CPU path."""
