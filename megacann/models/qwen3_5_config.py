"""The keys of the Qwen3.5 families (``model.type: qwen3_5``, ``qwen3_5_moe``), on top of those every decoder
(and MoE model) has. Their config.json names are Hugging Face's (``Qwen3_5TextConfig``,
``Qwen3_5MoeTextConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, Optional

from megacann.config import ConfigError, ModelConfig
from megacann.models.layer_types import check_layer_types
from megacann.models.moe_config import MoEModelConfig

LINEAR, FULL = "linear_attention", "full_attention"
LAYER_TYPES = (LINEAR, FULL)
FULL_ATTENTION_INTERVAL = 4  # transformers' default: every fourth layer full attention, the others linear


@dataclass
class _HybridKeys:
    """Qwen3.5's layers: ``layer_types`` names each layer's token mixer, ``linear_attention`` (a Gated
    DeltaNet of ``linear_num_key_heads`` / ``linear_num_value_heads`` heads of width ``linear_key_head_dim``
    / ``linear_value_head_dim``, convolution of ``linear_conv_kernel_dim`` taps) or ``full_attention``
    (heads of width ``head_dim`` with q/k norms, an output gate, and RoPE on the first
    ``partial_rotary_factor`` of each head); None: every fourth layer full, as transformers fills it."""

    head_dim: Optional[int] = field(default=None, metadata={"shape": True})
    layer_types: Optional[list] = field(default=None, metadata={"architecture": True})
    partial_rotary_factor: float = field(default=0.25, metadata={"architecture": True})
    linear_conv_kernel_dim: int = field(default=4, metadata={"shape": True})
    linear_key_head_dim: int = field(default=128, metadata={"shape": True})
    linear_value_head_dim: int = field(default=128, metadata={"shape": True})
    linear_num_key_heads: int = field(default=16, metadata={"shape": True})
    linear_num_value_heads: int = field(default=32, metadata={"shape": True})


_HYBRID_HF_KEYS = {name: name for name in (f.name for f in fields(_HybridKeys))}


@dataclass
class Qwen35ModelConfig(_HybridKeys, ModelConfig):
    """Qwen3.5 (text, dense): the hybrid layers (above), each with a dense SwiGLU MLP."""

    HF_KEYS: ClassVar[dict[str, str]] = {**ModelConfig.HF_KEYS, **_HYBRID_HF_KEYS}

    type: str = "qwen3_5"


@dataclass
class Qwen35MoeModelConfig(_HybridKeys, MoEModelConfig):
    """Qwen3.5-MoE (text): the hybrid layers, each with an MoE layer of ``num_experts`` experts of width
    ``moe_ffn_hidden_size`` (config.json: ``moe_intermediate_size``), softmax over all, top ``moe_top_k``
    renormalised, and one shared expert of width ``shared_expert_intermediate_size`` gated per token by
    ``sigmoid(shared_expert_gate(x))``."""

    HF_KEYS: ClassVar[dict[str, str]] = {
        **MoEModelConfig.HF_KEYS,
        **_HYBRID_HF_KEYS,
        "moe_intermediate_size": "moe_ffn_hidden_size",
        "shared_expert_intermediate_size": "shared_expert_intermediate_size",
    }

    type: str = "qwen3_5_moe"
    shared_expert_intermediate_size: Optional[int] = field(default=None, metadata={"shape": True})


def qwen3_5_layer_types(cfg: ModelConfig) -> list[str]:
    """Each layer's token mixer: ``layer_types``, or transformers' default (every fourth layer full)."""
    if cfg.layer_types is not None:
        return list(cfg.layer_types)
    return [FULL if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else LINEAR for i in range(cfg.num_layers)]


def rotary_dims(cfg: ModelConfig, head_dim: int) -> int:
    """How many dims of each full-attention head RoPE turns (transformers: ``int(head_dim * factor)``)."""
    return int(head_dim * cfg.partial_rotary_factor)


def check_qwen3_5_keys(cfg: ModelConfig, source: str, head_dim: int) -> None:
    """Refuse, naming the key and value, what megacann's qwen3_5 does not implement: a layer type other
    than linear / full attention, a layer_types list of the wrong length, a rotary scaling, a partial
    rotary width that is not a positive even number of dims, biases, value heads not a multiple of key heads."""
    check_layer_types(cfg.layer_types, cfg.num_layers, LAYER_TYPES, cfg.type, "token mixer", source)
    if cfg.rope_scaling:
        rope = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
        raise ConfigError(
            f"{source}: rope_type {rope!r} is not implemented by megacann's {cfg.type} (expected 'default')"
        )
    width = rotary_dims(cfg, head_dim)
    if not 0 < cfg.partial_rotary_factor <= 1 or width < 2 or width % 2:
        raise ConfigError(
            f"{source}: partial_rotary_factor {cfg.partial_rotary_factor} gives {width} rotary dims of head_dim "
            f"{head_dim}; expected a factor in (0, 1] giving a positive even number"
        )
    if cfg.add_bias_linear:
        raise ConfigError(f"{source}: attention_bias (model.add_bias_linear) true is refused: Qwen3.5 has no biases")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError(
            f"{source}: linear_num_value_heads {cfg.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads {cfg.linear_num_key_heads}"
        )
