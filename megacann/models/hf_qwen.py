"""The Hugging Face adapters of the Qwen families: ``Qwen2ForCausalLM`` (Qwen2 / Qwen2.5), ``Qwen3ForCausalLM``
and ``Qwen3MoeForCausalLM`` checkpoints.

Names are LLaMA's (:mod:`megacann.models.hf_llama`, whose fused ``qkv_proj`` splits by ``head_dim``): the q,
k, v biases of Qwen2 and the per-head norms of Qwen3 (``self_attn.q_norm`` / ``k_norm``) are named alike on
both sides. A Qwen3-MoE layer maps as::

    layers.<i>.mlp.router.weight                    model.layers.<i>.mlp.gate.weight
    layers.<i>.mlp.experts.<e>.gate_up_proj.weight  cat(...mlp.experts.<e>.gate_proj.weight, ...up_proj.weight)
    layers.<i>.mlp.experts.<e>.down_proj.weight     model.layers.<i>.mlp.experts.<e>.down_proj.weight

and its dense layers (``mlp_only_layers``) as LLaMA's MLP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from megacann.config import ConfigError, ModelConfig
from megacann.models import hf_llama
from megacann.models.hf_mixtral import ExpertLayout, expert_parts, experts_from_hf, experts_to_hf
from megacann.models.qwen_config import qwen3_moe_layer_flags
from megacann.models.sizing import attention_head_dim
from megacann.models.spec import HFAdapter

QWEN3_MOE_LAYOUT = ExpertLayout("model.layers.{layer}.mlp", gate="gate_proj", up="up_proj", down="down_proj")
Reader = Callable[[str], torch.Tensor]


def check_qwen3_moe_compatible(cfg: ModelConfig) -> None:
    """Refuse MoE settings a Qwen3-MoE checkpoint cannot express, naming the key."""
    if cfg.moe_bias_update_rate != 0:
        raise ConfigError(
            f"model.moe_bias_update_rate {cfg.moe_bias_update_rate!r} cannot be written as Qwen3-MoE: it has no "
            "routing bias (0)"
        )


def moe_parts(name: str, cfg: ModelConfig) -> list[tuple[str, Optional[int]]]:
    """Hugging Face names (and rows) of a Qwen3-MoE weight: experts as :data:`QWEN3_MOE_LAYOUT`, the rest
    as LLaMA's (``HFAdapter.linear_parts``: PEFT adapter names)."""
    check_qwen3_moe_compatible(cfg)
    return expert_parts(name, cfg, QWEN3_MOE_LAYOUT, hf_llama.hf_parts)


def moe_to_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    check_qwen3_moe_compatible(cfg)
    return experts_to_hf(tensors, cfg, QWEN3_MOE_LAYOUT)


def moe_from_hf(names: Sequence[str], read: Reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return experts_from_hf(names, read, cfg, QWEN3_MOE_LAYOUT)


# -- config.json ----------------------------------------------------------------------------------------


def _hf_config(cfg: ModelConfig, dtype: torch.dtype, architecture: str, model_type: str) -> dict[str, Any]:
    config = hf_llama.hf_config_dict(cfg, dtype)
    for key in ("mlp_bias", "attention_bias"):
        config.pop(key)
    config.update(architectures=[architecture], model_type=model_type, use_sliding_window=False, sliding_window=None)
    return config


def qwen2_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    return _hf_config(cfg, dtype, "Qwen2ForCausalLM", "qwen2")


def qwen3_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    config = _hf_config(cfg, dtype, "Qwen3ForCausalLM", "qwen3")
    config.update(head_dim=attention_head_dim(cfg), attention_bias=False)
    return config


def qwen3_moe_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    check_qwen3_moe_compatible(cfg)
    config = _hf_config(cfg, dtype, "Qwen3MoeForCausalLM", "qwen3_moe")
    config.update(
        head_dim=attention_head_dim(cfg),
        attention_bias=False,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers),
        router_aux_loss_coef=cfg.moe_aux_loss_coeff,
    )
    return config


def _reader(family: str) -> Callable[..., ModelConfig]:
    def read(config_file: str, raw: Optional[dict[str, Any]] = None) -> ModelConfig:
        return hf_llama.model_config_from_hf(config_file, family=family, raw=raw)

    return read


def qwen3_moe_config_from_hf(config_file: str, raw: Optional[dict[str, Any]] = None) -> ModelConfig:
    """A qwen3_moe ModelConfig from config.json, its MoE layers (``moe_layer_freq``) derived."""
    cfg = hf_llama.model_config_from_hf(config_file, family="qwen3_moe", raw=raw)
    if cfg.num_experts is None or cfg.moe_ffn_hidden_size is None:
        raise ConfigError(f"{config_file}: num_experts and moe_intermediate_size are needed for a Qwen3-MoE model")
    if cfg.decoder_sparse_step >= 1 and cfg.num_layers:
        cfg.moe_layer_freq = qwen3_moe_layer_flags(cfg)
    return cfg


QWEN2_HF = HFAdapter(
    model_types=("qwen2",),
    config_from_hf=_reader("qwen2"),
    config_to_hf=qwen2_config_dict,
    to_hf=hf_llama.to_hf_tensors,
    from_hf=hf_llama.from_hf_tensors,
    linear_parts=hf_llama.hf_parts,
)
QWEN3_HF = HFAdapter(
    model_types=("qwen3",),
    config_from_hf=_reader("qwen3"),
    config_to_hf=qwen3_config_dict,
    to_hf=hf_llama.to_hf_tensors,
    from_hf=hf_llama.from_hf_tensors,
    linear_parts=hf_llama.hf_parts,
)
QWEN3_MOE_HF = HFAdapter(
    model_types=("qwen3_moe",),
    config_from_hf=qwen3_moe_config_from_hf,
    config_to_hf=qwen3_moe_config_dict,
    to_hf=moe_to_hf,
    from_hf=moe_from_hf,
    linear_parts=moe_parts,
)
