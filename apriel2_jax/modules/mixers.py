"""Building a mixer module from its config, and the stochastic (supernet) mixer that holds several."""

from __future__ import annotations

from flax import nnx

from ..config import AttentionConfig, GDNConfig, KDAConfig, LeafMixerConfig, MambaConfig, StochasticConfig
from .attention import Attention
from .gdn import GatedDeltaNet
from .kda import KimiDeltaAttention
from .mamba import Mamba

_LEAF_MODULES = {AttentionConfig: Attention, GDNConfig: GatedDeltaNet, KDAConfig: KimiDeltaAttention, MambaConfig: Mamba}

LeafMixer = Attention | GatedDeltaNet | KimiDeltaAttention | Mamba


def build_leaf_mixer(cfg: LeafMixerConfig, hidden_size: int, *, dtype, rngs: nnx.Rngs) -> LeafMixer:
    return _LEAF_MODULES[type(cfg)](cfg, hidden_size, dtype=dtype, rngs=rngs)


class StochasticMixer(nnx.Module):
    """A supernet layer: every sub-mixer's parameters under ``mixers.{name}``; the placement picks which runs."""

    def __init__(self, cfg: StochasticConfig, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.mixers = nnx.Dict({name: build_leaf_mixer(sub, hidden_size, dtype=dtype, rngs=rngs) for name, sub in cfg.mixers})

    def select(self, name: str) -> LeafMixer:
        return self.mixers[name]


def build_mixer(cfg, hidden_size: int, *, dtype, rngs: nnx.Rngs) -> LeafMixer | StochasticMixer:
    if isinstance(cfg, StochasticConfig):
        return StochasticMixer(cfg, hidden_size, dtype=dtype, rngs=rngs)
    return build_leaf_mixer(cfg, hidden_size, dtype=dtype, rngs=rngs)


def active(mixer: LeafMixer | StochasticMixer, name: str | None) -> LeafMixer:
    """The module that runs for a layer under a placement entry (None for fixed layers)."""
    if isinstance(mixer, StochasticMixer):
        if name is None:
            raise ValueError("a stochastic layer needs a mixer name from the placement")
        return mixer.select(name)
    return mixer


__all__ = ["build_mixer", "active", "StochasticMixer", "LeafMixer"]
