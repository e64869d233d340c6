"""The Hugging Face adapter of the LLaMA family: names and settings of ``LlamaForCausalLM`` checkpoints.

megacann's names are Hugging Face's without the ``model.`` prefix, except where megacann fuses
projections (``mlp.gate_up_proj`` = gate then up; ``self_attn.qkv_proj`` = q, k, v), which are split and
joined here. Reading and writing directories is :mod:`megacann.models.hf`'s job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any, Callable

import torch

from megacann.config import ConfigError, ModelConfig, load_hf_model_config
from megacann.models.spec import HFAdapter

HEAD = "lm_head.weight"


def _hf_name(name: str) -> str:
    return name if name == HEAD else "model." + name


def to_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megacann whole tensors -> Hugging Face names (fused projections split)."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q_size, kv_size = cfg.num_attention_heads * head_dim, cfg.kv_heads * head_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        hf = _hf_name(name)
        if ".mlp.gate_up_proj." in name:
            gate, up = torch.split(tensor, [cfg.ffn_size, cfg.ffn_size], dim=0)
            out[hf.replace("gate_up_proj", "gate_proj")] = gate
            out[hf.replace("gate_up_proj", "up_proj")] = up
        elif ".self_attn.qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), torch.split(tensor, [q_size, kv_size, kv_size])):
                out[hf.replace("qkv_proj", part)] = piece
        else:
            out[hf] = tensor
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_tensors(
    names: Sequence[str], read: Callable[[str], torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """The whole tensors of megacann ``names``, read by Hugging Face name through ``read(hf_name)``."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        hf = _hf_name(name)
        if ".mlp.gate_up_proj." in name:
            out[name] = torch.cat([read(hf.replace("gate_up_proj", p)) for p in ("gate_proj", "up_proj")], dim=0)
        elif ".self_attn.qkv_proj." in name:
            out[name] = torch.cat([read(hf.replace("qkv_proj", p)) for p in ("q_proj", "k_proj", "v_proj")], dim=0)
        elif name == HEAD and cfg.tie_word_embeddings:
            out[name] = read("model.embed_tokens.weight")
        else:
            out[name] = read(hf)
    return out


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.use_bias,
        "mlp_bias": False,
        "hidden_act": "silu",
        "initializer_range": cfg.init_method_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def model_config_from_hf(config_file: str, family: str = "llama") -> ModelConfig:
    """A ModelConfig of ``family`` (LLaMA's, or one built on it) from a Hugging Face config.json (fp32
    unless the caller says otherwise)."""
    values = load_hf_model_config(config_file)
    names = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{config_file}: unknown model settings {unknown}")
    values.update(type=family, precision=values.get("precision", "fp32"))
    values.setdefault("add_bias_linear", False)
    return ModelConfig(**values)


LLAMA_HF = HFAdapter(
    model_types=("llama",),
    config_from_hf=model_config_from_hf,
    config_to_hf=hf_config_dict,
    to_hf=to_hf_tensors,
    from_hf=from_hf_tensors,
)
