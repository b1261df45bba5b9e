"""Flax NNX modules: they hold parameters (HF key layout) and call the ops through the dispatch point."""

from .model import Apriel2ForCausalLM, Block, Cache, checkpoint_key

__all__ = ["Apriel2ForCausalLM", "Block", "Cache", "checkpoint_key"]
