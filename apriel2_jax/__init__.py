"""apriel2-jax: JAX/Pallas inference for Apriel2 hybrid language models."""

from .config import Apriel2Config, ConfigError, load_config, parse_config

__all__ = ["Apriel2Config", "ConfigError", "load_config", "parse_config"]
