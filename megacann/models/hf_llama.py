"""The Hugging Face adapter of the LLaMA family: names and settings of ``LlamaForCausalLM`` checkpoints.

megacann's names are Hugging Face's without the ``model.`` prefix, except where megacann fuses
projections (``mlp.gate_up_proj`` = gate then up; ``self_attn.qkv_proj`` = q, k, v), which are split and
joined here. Reading and writing directories is :mod:`megacann.interop.hf`'s job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from megacann.config import ModelConfig, load_hf_model_config, model_config_class
from megacann.models.sizing import attention_head_dim
from megacann.models.spec import HFAdapter

HEAD = "lm_head.weight"


def _hf_name(name: str) -> str:
    return name if name == HEAD else "model." + name


def hf_parts(name: str, cfg: ModelConfig) -> list[tuple[str, Optional[int]]]:
    """The Hugging Face names of megacann weight ``name`` with the output rows of each (rows None: the
    whole tensor). Fused projections are several parts: gate then up, or q, k, v."""
    hf = _hf_name(name)
    if ".mlp.gate_up_proj." in name:
        return [(hf.replace("gate_up_proj", part), cfg.ffn_size) for part in ("gate_proj", "up_proj")]
    if ".self_attn.qkv_proj." in name:
        head_dim = attention_head_dim(cfg)
        rows = (cfg.num_attention_heads * head_dim, cfg.kv_heads * head_dim, cfg.kv_heads * head_dim)
        return [(hf.replace("qkv_proj", part), size) for part, size in zip(("q_proj", "k_proj", "v_proj"), rows)]
    return [(hf, None)]


def to_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megacann whole tensors -> Hugging Face names (fused projections split)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        parts = hf_parts(name, cfg)
        if len(parts) == 1:
            out[parts[0][0]] = tensor
            continue
        for (hf, _), piece in zip(parts, torch.split(tensor, [rows for _, rows in parts], dim=0)):
            out[hf] = piece
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_tensors(
    names: Sequence[str], read: Callable[[str], torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """The whole tensors of megacann ``names``, read by Hugging Face name through ``read(hf_name)``."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name == HEAD and cfg.tie_word_embeddings:
            out[name] = read("model.embed_tokens.weight")
            continue
        parts = hf_parts(name, cfg)
        out[name] = read(parts[0][0]) if len(parts) == 1 else torch.cat([read(hf) for hf, _ in parts], dim=0)
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


def model_config_from_hf(config_file: str, family: str = "llama", raw: Optional[dict[str, Any]] = None) -> ModelConfig:
    """The configuration of ``family`` (LLaMA's, or one built on it) from a Hugging Face config.json (fp32
    unless the caller says otherwise; ``raw``: the file already parsed, else read here); the family's
    configuration class maps its own keys."""
    config_class = model_config_class(family, config_file)
    values = load_hf_model_config(config_file, config_class, raw)
    values.update(type=family, precision=values.get("precision", "fp32"))
    values.setdefault("add_bias_linear", False)
    return config_class(**values)


LLAMA_HF = HFAdapter(
    model_types=("llama",),
    config_from_hf=model_config_from_hf,
    config_to_hf=hf_config_dict,
    to_hf=to_hf_tensors,
    from_hf=from_hf_tensors,
    linear_parts=hf_parts,
)
