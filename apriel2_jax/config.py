"""Typed, immutable Apriel2 configuration parsed from an HF ``config.json``.

Every field of the reference's schema (spec §1) is represented. Parsing is strict where the reference would
fail or silently compute something else, and every error names the JSON path of the offending field, the value
found, and what was expected, so a user can fix the file without reading this code.

Reference quirks reproduced on purpose (search for "QUIRK"):
  * block norms use ``head.normalization.epsilon``, not the block's own epsilon (spec §2.1);
  * Mamba reads ``state_size``; a ``d_state`` field is ignored, as in HF (spec §1.3);
  * Mamba adds ``dt_proj.bias`` twice (spec §2.8; implemented in ``ops/mamba.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, ClassVar, Mapping, Union

__all__ = [
    "ConfigError",
    "RotaryConfig",
    "AttentionConfig",
    "GDNConfig",
    "KDAConfig",
    "MambaConfig",
    "StochasticConfig",
    "MixerConfig",
    "MLPConfig",
    "NormConfig",
    "BlockConfig",
    "Apriel2Config",
    "parse_config",
    "load_config",
]


class ConfigError(ValueError):
    """A config field is missing, malformed or unsupported.

    ``path`` is the dotted JSON path (``decoder.blocks.swa.mixer.window_size``), ``value`` what was found.
    """

    def __init__(self, path: str, value: Any, expected: str, source: str | None = None):
        self.path = path
        self.value = value
        self.expected = expected
        self.source = source
        where = f" in {source}" if source else ""
        shown = "<missing>" if value is _MISSING else repr(value)
        super().__init__(f"config field '{path}'{where}: got {shown}, expected {expected}")


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


class _Node:
    """A JSON object together with its path, with typed field accessors that raise ``ConfigError``."""

    def __init__(self, data: Any, path: str):
        if not isinstance(data, Mapping):
            raise ConfigError(path or "<root>", data, "a JSON object")
        self.data = data
        self.path = path

    def sub(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        # An explicit JSON null counts as absent, as the reference's ``dict.get(..) or default`` idioms do.
        value = self.data.get(key, _MISSING)
        if value is _MISSING or value is None:
            if default is _MISSING:
                raise ConfigError(self.sub(key), value, "a value (this field is required)")
            return default
        return value

    def node(self, key: str, default: Any = _MISSING) -> "_Node":
        return _Node(self.raw(key, default), self.sub(key))

    def int(self, key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(self.sub(key), value, f"an integer >= {minimum}")
        return value

    def float(self, key: str, default: Any = _MISSING, *, positive: bool = True) -> float:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(self.sub(key), value, "a finite number")
        if positive and value <= 0:
            raise ConfigError(self.sub(key), value, "a number > 0")
        return float(value)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise ConfigError(self.sub(key), value, "true or false")
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: Any = _MISSING) -> str:
        value = self.raw(key, default)
        if value not in choices:
            raise ConfigError(self.sub(key), value, "one of " + ", ".join(repr(c) for c in choices))
        return value

    def bias(self, key: str, default: bool) -> bool:
        """A per-layer ``{"bias": {"enabled": bool}}`` override, falling back to ``default``."""
        if self.data.get(key) is None:
            return default
        layer = self.node(key)
        if layer.data.get("bias") is None:
            return default
        enabled = layer.node("bias").raw("enabled", None)
        if enabled is None:
            return default
        if not isinstance(enabled, bool):
            raise ConfigError(layer.node("bias").sub("enabled"), enabled, "true, false or null")
        return enabled


# --------------------------------------------------------------------------------------------------------------
# Mixers


@dataclasses.dataclass(frozen=True)
class RotaryConfig:
    type: str
    theta: float


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    kind: ClassVar[str] = "attention"
    heads: int
    head_groups: int
    head_size: int
    rotary: RotaryConfig
    window_size: int | None
    q_bias: bool
    k_bias: bool
    v_bias: bool
    o_bias: bool

    @property
    def is_sliding(self) -> bool:
        return self.window_size is not None

    @property
    def cache_family(self) -> str:
        """Layers that allocate K/V pages identically share a page pool: full attention, or one per window."""
        return "full" if self.window_size is None else f"window_{self.window_size}"


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    kind: ClassVar[str] = "gdn"
    value_heads: int
    key_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int
    norm_eps: float

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    kind: ClassVar[str] = "kda"
    heads: int
    head_dim: int
    conv_kernel_size: int
    norm_eps: float
    norm_activation: str  # "silu" or "sigmoid"

    @property
    def projection_size(self) -> int:
        return self.heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    kind: ClassVar[str] = "mamba"
    d_inner: int
    d_xb: int
    state_size: int
    dt_rank: int
    d_conv: int
    repeat_kv_before_conv: bool
    conv_bias: bool
    dt_proj_bias: bool
    add_linear_biases: bool

    @property
    def conv_channels(self) -> int:
        return self.d_inner if self.repeat_kv_before_conv else self.d_xb


LeafMixerConfig = Union[AttentionConfig, GDNConfig, KDAConfig, MambaConfig]


@dataclasses.dataclass(frozen=True)
class StochasticConfig:
    """A supernet layer: several named sub-mixers, one of which runs (chosen by a placement)."""

    kind: ClassVar[str] = "stochastic"
    mixers: tuple[tuple[str, LeafMixerConfig], ...]
    main_mixer_name: str
    sampling_strategy: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.mixers)

    def mixer(self, name: str) -> LeafMixerConfig:
        for key, cfg in self.mixers:
            if key == name:
                return cfg
        raise KeyError(name)


MixerConfig = Union[AttentionConfig, GDNConfig, KDAConfig, MambaConfig, StochasticConfig]


# --------------------------------------------------------------------------------------------------------------
# MLP, norms, blocks

# The MLP's activations: transformers' ACT2FN names without parameters (``prelu`` and ``xielu`` carry weights the
# checkpoint format has no keys for); ``ops.norms`` computes each.
_ACTIVATIONS = (
    "gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_pytorch_tanh", "gelu_python",
    "gelu_python_tanh", "hardswish", "laplace", "leaky_relu", "linear", "mish", "quick_gelu", "relu", "relu2", "relu6",
    "sigmoid", "silu", "sqrtsoftplus", "swish", "tanh",
)


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    intermediate_size: int
    activation: str
    gated: bool
    up_bias: bool
    down_bias: bool


@dataclasses.dataclass(frozen=True)
class NormConfig:
    type: str  # "rms_norm" or "layer_norm"
    epsilon: float


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    name: str
    mixer: MixerConfig
    mlp: MLPConfig
    # ``normalization.epsilon`` is recorded but, like the HF reference, the model uses the head epsilon.
    normalization: NormConfig


@dataclasses.dataclass(frozen=True)
class Apriel2Config:
    hidden_size: int
    vocab_size: int
    blocks: tuple[BlockConfig, ...]  # one per layer, pattern already resolved
    head_norm: NormConfig
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | tuple[int, ...] | None
    pad_token_id: int | None
    model_type: str

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def block_norm_epsilon(self) -> float:
        # QUIRK (spec §2.1): HF builds every block RMSNorm with the *head* epsilon, ignoring the block's own.
        return self.head_norm.epsilon

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def is_supernet(self) -> bool:
        return any(isinstance(b.mixer, StochasticConfig) for b in self.blocks)


# --------------------------------------------------------------------------------------------------------------
# Parsing


def _parse_attention(node: _Node, hidden_size: int) -> AttentionConfig:
    heads = node.int("heads")
    head_groups = node.int("head_groups", heads)
    if heads % head_groups:
        raise ConfigError(node.sub("head_groups"), head_groups, f"a divisor of heads ({heads})")
    head_size = node.int("head_size")
    if head_size % 2:
        raise ConfigError(node.sub("head_size"), head_size, "an even number (RoPE rotates halves)")
    rot = node.node("rotary")
    rot_type = rot.raw("type")
    if rot_type != "mistral_1d":
        hint = (
            " (pixtral_2d is the vision encoder's RoPE; llama3/yarn are rejected by the reference too)"
            if rot_type in ("pixtral_2d", "llama3", "yarn", "default")
            else ""
        )
        raise ConfigError(rot.sub("type"), rot_type, "'mistral_1d'" + hint)
    rotary = RotaryConfig(type=rot_type, theta=rot.float("theta"))
    window = node.raw("window_size", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(node.sub("window_size"), window, "null (full attention) or an integer >= 1")
    if node.raw("causal", True) is not True:
        raise ConfigError(node.sub("causal"), node.raw("causal"), "true (non-causal attention is vision-only)")
    if node.raw("cross_document_attention", True) is not True:
        raise ConfigError(
            node.sub("cross_document_attention"), node.raw("cross_document_attention"), "true (vision-only option)"
        )
    default_bias = node.bool("add_linear_biases", False)
    return AttentionConfig(
        heads=heads,
        head_groups=head_groups,
        head_size=head_size,
        rotary=rotary,
        window_size=window,
        q_bias=node.bias("query_layer", default_bias),
        k_bias=node.bias("key_layer", default_bias),
        v_bias=node.bias("value_layer", default_bias),
        o_bias=node.bias("dense_layer", default_bias),
    )


def _conv_node(node: _Node, key: str = "convolution_layer") -> _Node:
    conv = node.node(key)
    activation = conv.raw("activation", "silu")
    if activation != "silu":
        raise ConfigError(conv.sub("activation"), activation, "'silu' (the only convolution activation supported)")
    return conv


def _parse_gdn(node: _Node, hidden_size: int) -> GDNConfig:
    value_heads = node.int("value_heads", 32)
    key_heads = node.int("key_heads", 8)
    if value_heads % key_heads:
        raise ConfigError(node.sub("key_heads"), key_heads, f"a divisor of value_heads ({value_heads})")
    conv = _conv_node(node)
    return GDNConfig(
        value_heads=value_heads,
        key_heads=key_heads,
        key_head_dim=node.int("key_head_dim", 64),
        value_head_dim=node.int("value_head_dim", 64),
        conv_kernel_size=conv.int("kernel_size"),
        norm_eps=node.float("norm_eps", 1e-5),
    )


def _parse_kda(node: _Node, hidden_size: int) -> KDAConfig:
    conv = _conv_node(node) if node.data.get("convolution_layer") is not None else None
    norm = node.node("normalization", {})
    return KDAConfig(
        heads=node.int("heads", 32),
        head_dim=node.int("head_dim", 64),
        conv_kernel_size=conv.int("kernel_size", 4) if conv is not None else 4,
        norm_eps=norm.float("epsilon", 1e-5),
        norm_activation=norm.choice("activation", ("silu", "sigmoid"), "silu"),
    )


def _parse_mamba(node: _Node, hidden_size: int) -> MambaConfig:
    # QUIRK (spec §1.3): HF reads ``state_size`` only; surgery configs that write ``d_state`` get N = 16 there.
    state_size = node.int("state_size", 16)
    if "d_inner" in node.data and node.data["d_inner"] is not None:
        d_inner = node.int("d_inner")
    else:
        d_inner = node.int("expand", 2) * hidden_size
    d_xb = node.int("d_xb", hidden_size)
    dt_rank_raw = node.raw("dt_rank", "auto")
    dt_rank = math.ceil(hidden_size / 16) if dt_rank_raw == "auto" else node.int("dt_rank")
    for key, value in (("d_inner", d_inner), ("d_xb", d_xb)):
        if value % state_size:
            raise ConfigError(node.sub(key), value, f"a multiple of state_size ({state_size})")
    if d_inner % d_xb:
        raise ConfigError(node.sub("d_xb"), d_xb, f"a divisor of d_inner ({d_inner})")
    return MambaConfig(
        d_inner=d_inner,
        d_xb=d_xb,
        state_size=state_size,
        dt_rank=dt_rank,
        d_conv=node.int("d_conv", 4),
        repeat_kv_before_conv=node.bool("repeat_kv_before_conv", True),
        conv_bias=node.bool("conv_bias"),
        dt_proj_bias=node.bool("dt_proj_bias"),
        add_linear_biases=node.bool("add_linear_biases", False),
    )


_LEAF_PARSERS = {"attention": _parse_attention, "gdn": _parse_gdn, "kda": _parse_kda, "mamba": _parse_mamba}
_SAMPLING = ("uniform", "weighted")


def _parse_mixer(node: _Node, hidden_size: int, *, allow_stochastic: bool = True) -> MixerConfig:
    kind = node.raw("type", "attention")
    if kind == "stochastic":
        if not allow_stochastic:
            raise ConfigError(node.sub("type"), kind, "a non-stochastic mixer type (supernets cannot nest)")
        mixers_node = node.node("mixers")
        if not mixers_node.data:
            raise ConfigError(mixers_node.path, dict(mixers_node.data), "at least one named sub-mixer")
        mixers = tuple(
            (str(name), _parse_mixer(mixers_node.node(name), hidden_size, allow_stochastic=False))
            for name in mixers_node.data
        )
        names = tuple(name for name, _ in mixers)
        main = node.raw("main_mixer_name", names[0])
        if main not in names:
            raise ConfigError(node.sub("main_mixer_name"), main, "one of the sub-mixer names " + repr(list(names)))
        return StochasticConfig(
            mixers=mixers, main_mixer_name=main, sampling_strategy=node.choice("sampling_strategy", _SAMPLING, "uniform")
        )
    if kind not in _LEAF_PARSERS:
        hint = " (write type 'attention' with a window_size)" if kind == "sliding_window" else ""
        raise ConfigError(node.sub("type"), kind, "one of 'attention', 'gdn', 'kda', 'mamba', 'stochastic'" + hint)
    return _LEAF_PARSERS[kind](node, hidden_size)


def _parse_mlp(node: _Node) -> MLPConfig:
    kind = node.raw("type", "mlp")
    if kind != "mlp":
        raise ConfigError(node.sub("type"), kind, "'mlp'")
    gated = node.bool("gated", True)
    default_bias = node.bool("add_linear_biases", False)
    return MLPConfig(
        intermediate_size=node.int("intermediate_size"),
        activation=node.choice("activation", _ACTIVATIONS, "silu"),
        gated=gated,
        # The reference's gated MLP is transformers' MistralMLP, which never has biases (spec §1.3).
        up_bias=False if gated else node.bias("layer_1", default_bias),
        down_bias=False if gated else node.bias("layer_2", default_bias),
    )


def _parse_norm(node: _Node) -> NormConfig:
    return NormConfig(
        type=node.choice("type", ("rms_norm", "layer_norm"), "rms_norm"), epsilon=node.float("epsilon", 1e-5)
    )


def _parse_block(node: _Node, name: str, hidden_size: int) -> BlockConfig:
    return BlockConfig(
        name=name,
        mixer=_parse_mixer(node.node("mixer", {}), hidden_size),
        mlp=_parse_mlp(node.node("mlp")),
        normalization=_parse_norm(node.node("normalization", {})),
    )


def _optional_token(node: _Node, key: str, default: Any) -> Any:
    value = node.raw(key, default)
    if value is None:
        return None
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(node.sub(key), value, "null, a token id >= 0, or a list of token ids")
    return value


def parse_config(data: Mapping[str, Any], source: str | None = None) -> Apriel2Config:
    """Parse an HF ``config.json`` dict. ``source`` (a file path) is named in errors."""
    try:
        return _parse_config(data)
    except ConfigError as err:
        if source and err.source is None:
            raise ConfigError(err.path, err.value, err.expected, source) from None
        raise


def _parse_config(data: Mapping[str, Any]) -> Apriel2Config:
    root = _Node(data, "")
    model_type = root.choice("model_type", ("apriel2_text", "apriel2"))
    hidden_size = root.int("hidden_size", 4096)
    decoder = root.node("decoder")
    dtype = decoder.choice("type", ("fixed", "pattern"), "fixed")
    num_blocks = decoder.int("num_blocks")
    if dtype == "fixed":
        block = _parse_block(decoder.node("block"), "block", hidden_size)
        blocks = (block,) * num_blocks
    else:
        blocks_node = decoder.node("blocks")
        pattern = decoder.raw("pattern")
        if not isinstance(pattern, list) or not pattern or not all(isinstance(p, str) for p in pattern):
            raise ConfigError(decoder.sub("pattern"), pattern, "a non-empty list of block names")
        parsed: dict[str, BlockConfig] = {}
        for i, name in enumerate(pattern):
            if name not in blocks_node.data:
                raise ConfigError(
                    f"{decoder.sub('pattern')}[{i}]", name, "a key of decoder.blocks " + repr(list(blocks_node.data))
                )
            if name not in parsed:
                parsed[name] = _parse_block(blocks_node.node(name), name, hidden_size)
        blocks = tuple(parsed[pattern[i % len(pattern)]] for i in range(num_blocks))
    head = root.node("head", {"normalization": {"type": "rms_norm", "epsilon": 1e-5}})
    head_norm = _parse_norm(head.node("normalization", {}))
    if head_norm.type != "rms_norm":
        raise ConfigError(head.sub("normalization.type"), head_norm.type, "'rms_norm' (the final norm is RMSNorm)")
    embeddings = root.node("embeddings", {"max_position_embeddings": 2048})
    return Apriel2Config(
        hidden_size=hidden_size,
        vocab_size=root.int("vocab_size", 32000),
        blocks=blocks,
        head_norm=head_norm,
        tie_word_embeddings=root.bool("tie_word_embeddings", False),
        max_position_embeddings=embeddings.int("max_position_embeddings", 2048),
        bos_token_id=_optional_token(root, "bos_token_id", 1),
        eos_token_id=_optional_token(root, "eos_token_id", 2),
        pad_token_id=_optional_token(root, "pad_token_id", None),
        model_type=model_type,
    )


def load_config(path: str | os.PathLike) -> Apriel2Config:
    """Read ``config.json`` from a checkpoint directory or a file path."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json at {path}: expected an HF checkpoint directory")
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise ConfigError("<root>", f"invalid JSON ({err})", "a JSON object", path) from None
    return parse_config(data, source=path)
