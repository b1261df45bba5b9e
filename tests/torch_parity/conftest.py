import jax
import pytest
import torch


@pytest.fixture(autouse=True)
def _fp32_highest():
    """float32 everywhere: jax without x64 and HIGHEST matmul precision; torch deterministic CPU fp32."""
    assert not jax.config.jax_enable_x64
    assert torch.get_default_dtype() == torch.float32
    torch.manual_seed(0)
    with jax.default_matmul_precision("highest"):
        yield
