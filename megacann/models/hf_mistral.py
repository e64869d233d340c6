"""The Hugging Face adapter of the Mistral family: names and settings of ``MistralForCausalLM`` checkpoints.

Mistral's tensors are named as LLaMA's, so the name maps, the split of fused projections and the PEFT
parts are :mod:`megacann.models.hf_llama`'s; only config.json differs (``model_type: mistral``,
``head_dim``, ``sliding_window``, no bias keys). Mistral has no biases: a model with them cannot be
written as Mistral and is refused.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megacann.config import ConfigError, ModelConfig
from megacann.models import hf_llama
from megacann.models.sizing import attention_head_dim
from megacann.models.spec import HFAdapter

FAMILY = "mistral"


def check_mistral_compatible(cfg: ModelConfig) -> None:
    """Refuse what a Mistral checkpoint cannot express, naming the key."""
    if cfg.add_bias_linear:
        raise ConfigError(
            f"model.add_bias_linear {cfg.add_bias_linear!r} cannot be written as Mistral: it has no biases"
        )


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a ``MistralForCausalLM`` with ``cfg``'s sizes, head width and window."""
    check_mistral_compatible(cfg)
    config = hf_llama.hf_config_dict(cfg, dtype)
    for key in ("attention_bias", "mlp_bias"):
        config.pop(key)
    config.update(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        head_dim=attention_head_dim(cfg),
        sliding_window=cfg.sliding_window,
        attention_dropout=cfg.attention_dropout,
    )
    return config


def model_config_from_hf(config_file: str, raw: Optional[dict[str, Any]] = None) -> ModelConfig:
    """A Mistral-family configuration from a Mistral config.json (``head_dim`` and ``sliding_window``
    included; ``null`` for either: the default)."""
    return hf_llama.model_config_from_hf(config_file, family=FAMILY, raw=raw)


MISTRAL_HF = HFAdapter(
    model_types=("mistral",),
    config_from_hf=model_config_from_hf,
    config_to_hf=hf_config_dict,
    to_hf=hf_llama.to_hf_tensors,
    from_hf=hf_llama.from_hf_tensors,
    linear_parts=hf_llama.hf_parts,
)
