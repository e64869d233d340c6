"""The Hugging Face adapter of gpt-oss: ``GptOssForCausalLM`` checkpoints both ways.

Attention (with its biases and ``self_attn.sinks``), norms, embeddings, the head and the router
(``mlp.router.weight`` / ``.bias``) carry LLaMA's names (``model.`` prefix, :mod:`megacann.models.hf_llama`).
Hugging Face keeps each layer's experts as stacked tensors, the gate and up columns interleaved; megacann
keeps one module per expert, gate rows then up rows (``F.linear`` layout)::

    layers.<i>.mlp.experts.<e>.gate_up_proj.weight  [2I, h]  cat(W[e][:, 0::2], W[e][:, 1::2])ᵀ  W = ...mlp.experts.gate_up_proj [E, h, 2I]
    layers.<i>.mlp.experts.<e>.gate_up_proj.bias    [2I]     cat(b[e][0::2], b[e][1::2])          b = ...gate_up_proj_bias [E, 2I]
    layers.<i>.mlp.experts.<e>.down_proj.weight     [h, I]   ...mlp.experts.down_proj[e]ᵀ            [E, I, h]
    layers.<i>.mlp.experts.<e>.down_proj.bias       [h]      ...mlp.experts.down_proj_bias[e]        [E, h]
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from megacann.config import ConfigError, ModelConfig
from megacann.config.hf_config import read_hf_config
from megacann.layers.lora.targets import MLP_PROJECTIONS
from megacann.models import hf_llama
from megacann.models.gpt_oss_config import check_gpt_oss_keys, gpt_oss_layer_types
from megacann.models.hf_mixtral import expert_parts
from megacann.models.hf_qwen import QWEN3_MOE_LAYOUT
from megacann.models.sizing import attention_head_dim
from megacann.models.spec import HFAdapter

_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_up_proj|down_proj)\.(weight|bias)$")
Reader = Callable[[str], torch.Tensor]


def _stacked_name(layer: str, proj: str, kind: str) -> str:
    """The Hugging Face name of a layer's stacked expert tensor."""
    return f"model.layers.{layer}.mlp.experts.{proj}" + ("_bias" if kind == "bias" else "")


def _expert_from_hf(stacked: torch.Tensor, proj: str, kind: str) -> torch.Tensor:
    """One expert's slice of a stacked Hugging Face tensor, in megacann's layout."""
    if proj == "down_proj":
        return stacked.t() if kind == "weight" else stacked
    gate_then_up = torch.cat([stacked[..., 0::2], stacked[..., 1::2]], dim=-1)  # de-interleave the columns
    return gate_then_up.t() if kind == "weight" else gate_then_up


def _expert_to_hf(tensor: torch.Tensor, proj: str, kind: str) -> torch.Tensor:
    """One expert's megacann tensor in the layout of a slice of the stacked Hugging Face tensor."""
    if proj == "down_proj":
        return tensor.t() if kind == "weight" else tensor
    gate, up = tensor.chunk(2, dim=0)  # rows (weight) or entries (bias): gate then up
    interleaved = torch.stack([gate, up], dim=1).flatten(0, 1)  # gate 0, up 0, gate 1, up 1, ...
    return interleaved.t() if kind == "weight" else interleaved


def to_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megacann whole tensors -> Hugging Face names, each layer's experts stacked in expert order."""
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    rest = {}
    for name, tensor in tensors.items():
        match = _EXPERT.match(name)
        if match is None:
            rest[name] = tensor
            continue
        layer, expert, proj, kind = match.groups()
        stacks.setdefault(_stacked_name(layer, proj, kind), {})[int(expert)] = _expert_to_hf(tensor, proj, kind)
    out = hf_llama.to_hf_tensors(rest, cfg)
    for hf, by_expert in stacks.items():
        if sorted(by_expert) != list(range(cfg.num_experts)):
            raise ValueError(f"{hf}: experts {sorted(by_expert)} given, all {cfg.num_experts} are needed")
        out[hf] = torch.stack([by_expert[e] for e in range(cfg.num_experts)]).contiguous()
    return out


def from_hf_tensors(names: Sequence[str], read: Reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole tensors of megacann ``names`` (experts cut from the stacked tensors, each read once)."""
    stacked: dict[str, torch.Tensor] = {}
    out = hf_llama.from_hf_tensors([n for n in names if not _EXPERT.match(n)], read, cfg)
    for name in names:
        match = _EXPERT.match(name)
        if match is None:
            continue
        layer, expert, proj, kind = match.groups()
        hf = _stacked_name(layer, proj, kind)
        if hf not in stacked:
            stacked[hf] = read(hf)
        out[name] = _expert_from_hf(stacked[hf][int(expert)], proj, kind).contiguous()
    return out


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else {"rope_type": "default"}
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    return {**scaling, "rope_theta": cfg.rope_theta}


def gpt_oss_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a ``GptOssForCausalLM``: LLaMA's keys, the rotary settings as ``rope_parameters``,
    and gpt-oss's own."""
    config = hf_llama.hf_config_dict(cfg, dtype)
    for key in ("mlp_bias", "rope_theta", "rope_scaling"):
        config.pop(key)
    config.update(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        intermediate_size=cfg.moe_ffn_hidden_size,
        head_dim=attention_head_dim(cfg),
        rope_parameters=_rope_parameters(cfg),
        sliding_window=cfg.sliding_window,
        layer_types=gpt_oss_layer_types(cfg),
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        router_aux_loss_coef=cfg.moe_aux_loss_coeff,
        swiglu_limit=cfg.swiglu_limit,
        swiglu_alpha=cfg.swiglu_alpha,
    )
    return config


def gpt_oss_config_from_hf(config_file: str, raw: Optional[dict[str, Any]] = None) -> ModelConfig:
    """A gpt_oss ModelConfig from config.json (attention biases on unless ``attention_bias`` says otherwise,
    as in transformers); layer types and rotary scalings megacann does not implement are refused, naming
    the key and value."""
    raw = read_hf_config(config_file) if raw is None else raw
    cfg = hf_llama.model_config_from_hf(config_file, family="gpt_oss", raw=raw)
    if "attention_bias" not in raw:
        cfg.add_bias_linear = True
    cfg.moe_ffn_hidden_size = cfg.ffn_hidden_size  # intermediate_size: every expert's width
    if cfg.num_experts is None:
        raise ConfigError(f"{config_file}: num_local_experts is needed for a gpt-oss model")
    check_gpt_oss_keys(cfg, config_file)
    return cfg


def linear_parts(name: str, cfg: ModelConfig) -> list[tuple[str, Optional[int]]]:
    """The Hugging Face names of a megacann linear weight (PEFT adapter names): the attention's as LLaMA's; the
    experts' per-expert names (as Qwen3-MoE's), which no transformers module has (see :func:`peft_refusal`)."""
    return expert_parts(name, cfg, QWEN3_MOE_LAYOUT, hf_llama.hf_parts)


def peft_refusal(targets: Sequence[str]) -> Optional[str]:
    """Why PEFT cannot hold LoRAs on gpt-oss's experts (None when no expert is targeted)."""
    named = [t for t in targets if t in MLP_PROJECTIONS]  # every MLP of gpt-oss is its experts
    if not named:
        return None
    return (
        f"{named} are refused for gpt_oss: its experts are stacked tensors in transformers (gate and up columns "
        "interleaved; MXFP4 in the published checkpoints), not linear modules PEFT's LoRA can adapt; target the "
        "attention projections (q_proj, k_proj, v_proj, o_proj)"
    )


GPT_OSS_HF = HFAdapter(
    model_types=("gpt_oss",),
    config_from_hf=gpt_oss_config_from_hf,
    config_to_hf=gpt_oss_config_dict,
    to_hf=to_hf_tensors,
    from_hf=from_hf_tensors,
    linear_parts=linear_parts,
    peft_refusal=peft_refusal,
)
