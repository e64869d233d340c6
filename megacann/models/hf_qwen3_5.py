"""The Hugging Face adapter of Qwen3.5: ``Qwen3_5ForCausalLM`` (``model_type: qwen3_5_text``) both ways.

Names are LLaMA's (:mod:`megacann.models.hf_llama`: ``model.`` prefix, fused gate/up split), except that a
linear-attention layer's Gated DeltaNet, which megacann's block holds as ``self_attn``, is Hugging Face's
``linear_attn`` (same parameter names below it). The full-attention ``q_proj`` keeps Hugging Face's rows:
per head its queries, then its gate logits. Hugging Face's RMSNorms outside the DeltaNet compute
``x̂ · (1 + w)``; megacann's compute ``x̂ · w'``, so ``w' = 1 + w`` on the way in and ``w = w' - 1`` on
the way out (the DeltaNet's gated norm multiplies by ``w`` itself and is copied as it is).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from megacann.config import ModelConfig
from megacann.config.hf_config import read_hf_config
from megacann.models import hf_llama
from megacann.models.qwen3_5_config import LINEAR, check_qwen3_5_keys, qwen3_5_layer_types
from megacann.models.sizing import attention_head_dim
from megacann.models.spec import HFAdapter

_LAYER = re.compile(r"^layers\.(\d+)\.self_attn\.")
# the norms Hugging Face stores as offsets from one: the layers' two, the final one, q/k norms
_OFFSET_NORM = re.compile(
    r"^(norm|layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm))\.weight$"
)
Reader = Callable[[str], torch.Tensor]


def _hf_layer_name(name: str, cfg: ModelConfig) -> str:
    """``name`` with a linear-attention layer's ``self_attn`` renamed ``linear_attn`` (others as they are)."""
    match = _LAYER.match(name)
    if match is None or qwen3_5_layer_types(cfg)[int(match.group(1))] != LINEAR:
        return name
    return name.replace(".self_attn.", ".linear_attn.", 1)


def _is_offset_norm(name: str, cfg: ModelConfig) -> bool:
    return _OFFSET_NORM.match(name) is not None and _hf_layer_name(name, cfg) == name


def to_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megacann whole tensors -> Hugging Face names and norm offsets."""
    renamed = {}
    for name, tensor in tensors.items():
        renamed[_hf_layer_name(name, cfg)] = tensor - 1 if _is_offset_norm(name, cfg) else tensor
    return hf_llama.to_hf_tensors(renamed, cfg)


def from_hf_tensors(names: Sequence[str], read: Reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole tensors of megacann ``names``, read by Hugging Face name (norms given their one back)."""
    hf_names = {name: _hf_layer_name(name, cfg) for name in names}
    loaded = hf_llama.from_hf_tensors(list(hf_names.values()), read, cfg)
    return {name: loaded[hf] + 1 if _is_offset_norm(name, cfg) else loaded[hf] for name, hf in hf_names.items()}


def linear_parts(name: str, cfg: ModelConfig) -> list[tuple[str, Optional[int]]]:
    """The Hugging Face names of a megacann linear weight (PEFT adapter names)."""
    return hf_llama.hf_parts(_hf_layer_name(name, cfg), cfg)


def qwen3_5_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a ``Qwen3_5ForCausalLM``: LLaMA's keys, the rotary settings as ``rope_parameters``,
    and Qwen3.5's own."""
    config = hf_llama.hf_config_dict(cfg, dtype)
    for key in ("mlp_bias", "rope_theta", "rope_scaling"):
        config.pop(key)
    config.update(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        head_dim=attention_head_dim(cfg),
        layer_types=qwen3_5_layer_types(cfg),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        },
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
    )
    return config


def qwen3_5_config_from_hf(config_file: str, raw: Optional[dict[str, Any]] = None) -> ModelConfig:
    """A qwen3_5 ModelConfig from config.json; layer types, rotary scalings and widths megacann does not
    implement are refused, naming the key and value."""
    raw = read_hf_config(config_file) if raw is None else raw
    cfg = hf_llama.model_config_from_hf(config_file, family="qwen3_5", raw=raw)
    check_qwen3_5_keys(cfg, config_file, attention_head_dim(cfg))
    return cfg


QWEN3_5_HF = HFAdapter(
    model_types=("qwen3_5_text",),
    config_from_hf=qwen3_5_config_from_hf,
    config_to_hf=qwen3_5_config_dict,
    to_hf=to_hf_tensors,
    from_hf=from_hf_tensors,
    linear_parts=linear_parts,
)
