"""The keys of the gpt-oss family (``model.type: gpt_oss``), on top of those every MoE model has. Their
config.json names are Hugging Face's (``GptOssConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from megacann.config import ConfigError, ModelConfig
from megacann.models.layer_types import check_layer_types
from megacann.models.moe_config import MoEModelConfig

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ROPE_TYPES = ("default", "yarn")  # the rotary scalings gpt-oss checkpoints use


@dataclass
class GptOssModelConfig(MoEModelConfig):
    """gpt-oss: every layer an MoE layer of ``num_experts`` experts of width ``ffn_hidden_size``
    (config.json: ``num_local_experts``, ``intermediate_size``) with biases and the clamped SwiGLU
    (``swiglu_limit``, ``swiglu_alpha``), a router with a bias (top ``moe_top_k``, softmax over the chosen);
    attention with biases (``attention_bias``), a learned sink per head and heads of width ``head_dim``;
    ``layer_types`` names each layer's attention: ``sliding_attention`` (its last ``sliding_window`` keys)
    or ``full_attention`` (None: alternating, sliding first, as transformers fills it)."""

    HF_KEYS: ClassVar[dict[str, str]] = {
        **MoEModelConfig.HF_KEYS,
        "head_dim": "head_dim",
        "sliding_window": "sliding_window",
        "layer_types": "layer_types",
        "swiglu_limit": "swiglu_limit",
        "swiglu_alpha": "swiglu_alpha",
    }
    HF_INERT_KEYS: ClassVar[dict[str, object]] = {
        k: v for k, v in MoEModelConfig.HF_INERT_KEYS.items() if k != "sliding_window"
    }

    type: str = "gpt_oss"
    head_dim: Optional[int] = field(default=None, metadata={"shape": True})
    sliding_window: Optional[int] = field(default=128, metadata={"architecture": True})
    layer_types: Optional[list] = field(default=None, metadata={"architecture": True})
    swiglu_limit: float = field(default=7.0, metadata={"architecture": True})
    swiglu_alpha: float = field(default=1.702, metadata={"architecture": True})


def gpt_oss_layer_types(cfg: ModelConfig) -> list[str]:
    """Each layer's attention kind: ``layer_types``, or transformers' default (sliding on even layers)."""
    if cfg.layer_types is not None:
        return list(cfg.layer_types)
    return [SLIDING if i % 2 == 0 else FULL for i in range(cfg.num_layers)]


def check_gpt_oss_keys(cfg: ModelConfig, source: str) -> None:
    """Refuse, naming the key and value, what megacann's gpt-oss does not implement: a layer type other
    than sliding / full attention, a rotary scaling other than YaRN, a layer_types list of the wrong length,
    a non-positive window or clamp."""
    check_layer_types(cfg.layer_types, cfg.num_layers, LAYER_TYPES, "gpt_oss", "attention kind", source)
    rope = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type", "default"))
    if rope not in ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope_type {rope!r} is not implemented by megacann's gpt_oss (expected {ROPE_TYPES})"
        )
    window = cfg.sliding_window
    if SLIDING in gpt_oss_layer_types(cfg) and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(
            f"{source}: sliding_window must be a positive integer for sliding_attention layers, got {window!r}"
        )
    if cfg.swiglu_limit <= 0:
        raise ConfigError(f"{source}: swiglu_limit must be > 0, got {cfg.swiglu_limit}")
    if cfg.moe_top_k < 2:
        raise ConfigError(
            f"{source}: num_experts_per_tok (model.moe_top_k) {cfg.moe_top_k} is refused: gpt-oss weighs the "
            "chosen experts by a softmax over them, which needs at least 2"
        )
