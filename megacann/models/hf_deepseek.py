"""The Hugging Face adapter of the DeepSeek-V3 family: ``DeepseekV3ForCausalLM`` checkpoints (DeepSeek-V3,
Moonlight and models of their layout).

Attention weights are named alike on both sides (``model.`` prefixed there; :class:`LatentAttention` uses
Hugging Face's names). An MoE layer maps as::

    layers.<i>.mlp.router.weight                        model.layers.<i>.mlp.gate.weight
    layers.<i>.mlp.router.expert_bias                   model.layers.<i>.mlp.gate.e_score_correction_bias
    layers.<i>.mlp.experts.<e>.gate_up_proj.weight      cat(...mlp.experts.<e>.gate_proj.weight, ...up_proj.weight)
    layers.<i>.mlp.experts.<e>.down_proj.weight         model.layers.<i>.mlp.experts.<e>.down_proj.weight
    layers.<i>.mlp.shared_experts.gate_up_proj.weight   cat(...mlp.shared_experts.gate_proj.weight, ...up_proj)
    layers.<i>.mlp.shared_experts.down_proj.weight      model.layers.<i>.mlp.shared_experts.down_proj.weight

(the per-expert layout of the published checkpoints, which transformers reads), dense layers as LLaMA's
MLP. Multi-token prediction depth ``j`` (``model.mtp_num_layers`` = config.json's
``num_nextn_predict_layers``) is decoder layer ``L + j`` there (``L = num_hidden_layers``)::

    mtp.layers.<j>.enorm / hnorm / eh_proj .weight      model.layers.<L+j>.enorm / hnorm / eh_proj .weight
    mtp.layers.<j>.final_layernorm.weight               model.layers.<L+j>.shared_head.norm.weight
    mtp.layers.<j>.transformer_layer.<rest>             model.layers.<L+j>.<rest> (as any layer's)

The model's embedding and head serve the depths; DeepSeek's checkpoints keep copies of them beside each
depth (``model.layers.<L+j>.embed_tokens``, ``shared_head.head``), which inference engines read for the
depth: they are written (copies of the model's) and not read. A config.json
naming depths whose weights its checkpoint lacks (transformers writes none) is read without them, with a
note (:func:`fit_mtp_to_weights`; the weights import says which tensors the checkpoint holds).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from megacann.config import ConfigError, ModelConfig
from megacann.config.advice import advise
from megacann.config.hf_config import read_hf_config
from megacann.models import hf_llama
from megacann.models.deepseek_config import deepseek_layer_flags
from megacann.models.hf_mixtral import ExpertLayout, expert_parts, experts_from_hf, experts_to_hf
from megacann.models.mtp import mtp_depths
from megacann.models.spec import HFAdapter

DEEPSEEK_LAYOUT = ExpertLayout("model.layers.{layer}.mlp", gate="gate_proj", up="up_proj", down="down_proj")
_BIAS = re.compile(r"layers\.(\d+)\.mlp\.router\.expert_bias")
_SHARED = re.compile(r"layers\.(\d+)\.mlp\.shared_experts\.gate_up_proj\.weight")
_HF_BIAS = "model.layers.{layer}.mlp.gate.e_score_correction_bias"
Reader = Callable[[str], torch.Tensor]
# transformers' DeepseekV3Config defaults of keys a config.json may leave out: config.json key -> (field, value)
HF_DEFAULTS = {
    "num_experts_per_tok": ("moe_top_k", 8),
    "n_shared_experts": ("moe_shared_experts", 1),
    "q_lora_rank": ("q_lora_rank", 1536),
    "n_group": ("n_group", 8),
    "topk_group": ("topk_group", 4),
    "routed_scaling_factor": ("routed_scaling_factor", 2.5),
    "first_k_dense_replace": ("first_k_dense_replace", 3),
    "rms_norm_eps": ("norm_eps", 1e-6),
}


_MTP = re.compile(r"mtp\.layers\.(\d+)\.(transformer_layer\.)?(.+)")
MTP_EMBEDDING_COPY = "mtp_embed_tokens.weight"  # a last pipeline stage's copy of embed_tokens.weight


def _as_layer(name: str, cfg: ModelConfig) -> str:
    """A multi-token prediction weight's name as that of decoder layer ``num_layers + depth`` (other names
    unchanged), so that it maps as the layers' do."""
    match = _MTP.fullmatch(name)
    if match is None:
        return name
    rest = "shared_head.norm.weight" if match[3] == "final_layernorm.weight" else match[3]
    return f"layers.{cfg.num_layers + int(match[1])}.{rest}"


def _own_parts(name: str, cfg: ModelConfig) -> Optional[list[tuple[str, Optional[int]]]]:
    """The parts of the weights this family adds to the MoE decoder's: the routing bias, the shared
    experts' fused gate/up projection (None for any other weight)."""
    if match := _BIAS.fullmatch(name):
        return [(_HF_BIAS.format(layer=match[1]), None)]
    if _SHARED.fullmatch(name):
        rows = cfg.moe_shared_experts * cfg.moe_ffn_hidden_size
        return [("model." + name.replace("gate_up_proj", part), rows) for part in ("gate_proj", "up_proj")]
    return None


def hf_parts(name: str, cfg: ModelConfig) -> list[tuple[str, Optional[int]]]:
    """Hugging Face names (and rows) of a DeepSeek-V3 weight (``HFAdapter.linear_parts``: PEFT names)."""
    name = _as_layer(name, cfg)
    own = _own_parts(name, cfg)
    return own if own is not None else expert_parts(name, cfg, DEEPSEEK_LAYOUT, hf_llama.hf_parts)


def to_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megacann whole tensors -> Hugging Face names."""
    out: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name == MTP_EMBEDDING_COPY:  # the copy of embed_tokens.weight a last stage holds
            continue
        name = _as_layer(name, cfg)
        parts = _own_parts(name, cfg)
        if parts is None:
            rest[name] = tensor
            continue
        for (hf, _), piece in zip(parts, torch.split(tensor, [rows or tensor.shape[0] for _, rows in parts])):
            out[hf] = piece.contiguous()
    out.update(experts_to_hf(rest, cfg, DEEPSEEK_LAYOUT))
    embedding = tensors.get("embed_tokens.weight")
    head = tensors.get("lm_head.weight", embedding)
    for depth in range(mtp_depths(cfg) if embedding is not None else 0):  # the copies each depth keeps
        layer = f"model.layers.{cfg.num_layers + depth}"
        out[f"{layer}.embed_tokens.weight"] = embedding.clone()
        out[f"{layer}.shared_head.head.weight"] = head.clone()
    return out


def from_hf_tensors(names: Sequence[str], read: Reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole tensors of megacann ``names``, read by Hugging Face name through ``read(hf_name)``."""
    out: dict[str, torch.Tensor] = {}
    rest, renamed = [], {}
    for name in names:
        layer_name = _as_layer(name, cfg)
        parts = _own_parts(layer_name, cfg)
        if parts is None:
            rest.append(layer_name)
            renamed[layer_name] = name
        else:
            out[name] = torch.cat([read(hf) for hf, _ in parts]) if len(parts) > 1 else read(parts[0][0])
    out.update({renamed[k]: v for k, v in experts_from_hf(rest, read, cfg, DEEPSEEK_LAYOUT).items()})
    return out


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a ``DeepseekV3ForCausalLM`` with ``cfg``'s settings."""
    config = hf_llama.hf_config_dict(cfg, dtype)
    for key in ("mlp_bias", "rope_scaling", "rope_theta"):
        config.pop(key)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    config.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        attention_bias=False,
        rope_parameters=rope,
        rope_interleave=cfg.rotary_interleaved,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        n_routed_experts=cfg.num_experts,
        n_shared_experts=cfg.moe_shared_experts,
        num_experts_per_tok=cfg.moe_top_k,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        first_k_dense_replace=cfg.first_k_dense_replace,
        num_nextn_predict_layers=mtp_depths(cfg),
    )
    config.update(balancing_keys(cfg))
    return config


def balancing_keys(cfg: ModelConfig) -> dict[str, Any]:
    """DeepSeek's own config.json keys of the balancing loss, where the recipe has one (or a non-default
    kind): ``aux_loss_alpha`` and always ``seq_aux`` beside it (DeepSeek's code takes a missing one as true)."""
    if cfg.moe_aux_loss_coeff == 0 and cfg.moe_router_load_balancing_type == "aux_loss":
        return {}
    return {
        "aux_loss_alpha": cfg.moe_aux_loss_coeff,
        "seq_aux": cfg.moe_router_load_balancing_type == "seq_aux_loss",
    }


def config_from_hf(config_file: str, raw: Optional[dict[str, Any]] = None, family: str = "deepseek_v3") -> ModelConfig:
    """A deepseek_v3 ModelConfig (or one of ``family``, built on it) from config.json (``raw``: the file
    already parsed, else read here; its MoE layers derived from ``first_k_dense_replace``)."""
    raw = read_hf_config(config_file) if raw is None else raw
    cfg = hf_llama.model_config_from_hf(config_file, family=family, raw=raw)
    if cfg.num_experts is None or cfg.moe_ffn_hidden_size is None:
        raise ConfigError(f"{config_file}: n_routed_experts and moe_intermediate_size are needed for DeepSeek-V3")
    for key, (field, value) in HF_DEFAULTS.items():  # what transformers assumes where config.json is silent
        if key not in raw:
            setattr(cfg, field, value)
    cfg.moe_layer_freq = deepseek_layer_flags(cfg)
    return cfg


def fit_mtp_to_weights(cfg: ModelConfig, holds: Callable[[str], bool], source: str) -> None:
    """Leave out the multi-token prediction depths when the checkpoint lacks their weights (``holds``: whether
    it has a Hugging Face tensor of that name; transformers writes none), with a note naming ``source``."""
    name = f"model.layers.{cfg.num_layers}.eh_proj.weight"
    if mtp_depths(cfg) and not holds(name):
        advise(
            f"{source}: num_nextn_predict_layers {mtp_depths(cfg)}, but the checkpoint beside it has no "
            f"multi-token prediction weights ({name}): read without them"
        )
        cfg.mtp_num_layers = 0


DEEPSEEK_V3_HF = HFAdapter(
    model_types=("deepseek_v3",),
    config_from_hf=config_from_hf,
    config_to_hf=hf_config_dict,
    to_hf=to_hf_tensors,
    from_hf=from_hf_tensors,
    linear_parts=hf_parts,
    fit_to_weights=fit_mtp_to_weights,
)
