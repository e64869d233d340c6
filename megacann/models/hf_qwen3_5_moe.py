"""The Hugging Face adapter of Qwen3.5-MoE: ``Qwen3_5MoeForCausalLM`` (``model_type: qwen3_5_moe_text``) both
ways.

Everything but the MoE layers maps as Qwen3.5 does (:mod:`megacann.models.hf_qwen3_5`); the router and
experts as Qwen3-MoE's (:data:`megacann.models.hf_qwen.QWEN3_MOE_LAYOUT`: transformers keeps the experts
fused in memory and writes them one by one). An MoE layer (megacann name, left; Hugging Face's under
``model.``, right)::

    layers.<i>.mlp.router.weight                              layers.<i>.mlp.gate.weight
    layers.<i>.mlp.experts.<e>.gate_up_proj.weight            cat(...mlp.experts.<e>.gate_proj.weight, ...up_proj.weight)
    layers.<i>.mlp.experts.<e>.down_proj.weight               layers.<i>.mlp.experts.<e>.down_proj.weight
    layers.<i>.mlp.shared_experts.expert.gate_up_proj.weight  cat(...mlp.shared_expert.gate_proj.weight, ...up_proj.weight)
    layers.<i>.mlp.shared_experts.expert.down_proj.weight     layers.<i>.mlp.shared_expert.down_proj.weight
    layers.<i>.mlp.shared_experts.gate_weight                 layers.<i>.mlp.shared_expert_gate.weight
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Optional

import torch

from megacann.config import ConfigError, ModelConfig
from megacann.config.hf_config import read_hf_config
from megacann.layers.lora.targets import MLP_PROJECTIONS
from megacann.models import hf_llama, hf_qwen3_5
from megacann.models.hf_mixtral import expert_parts, experts_from_hf, experts_to_hf
from megacann.models.hf_qwen import QWEN3_MOE_LAYOUT
from megacann.models.qwen3_5_config import check_qwen3_5_keys
from megacann.models.sizing import attention_head_dim
from megacann.models.spec import HFAdapter

_ROUTED = re.compile(r"^layers\.\d+\.mlp\.(router|experts)\.")  # the router (and its bias buffer), the experts
_SHARED_GATE_UP = re.compile(r"^(layers\.\d+\.mlp\.)shared_experts\.expert\.gate_up_proj\.weight$")
_SHARED_RENAMES = (  # megacann -> Hugging Face
    (re.compile(r"^(layers\.\d+\.mlp\.)shared_experts\.expert\.down_proj\.weight$"), r"model.\1shared_expert.down_proj.weight"),
    (re.compile(r"^(layers\.\d+\.mlp\.)shared_experts\.gate_weight$"), r"model.\1shared_expert_gate.weight"),
)  # fmt: skip


def _shared_parts(name: str) -> list[str]:
    """The Hugging Face names of a shared-expert weight (the fused gate_up_proj: gate then up); [] if it is none."""
    if match := _SHARED_GATE_UP.match(name):
        return [f"model.{match.group(1)}shared_expert.{p}.weight" for p in ("gate_proj", "up_proj")]
    return [pattern.sub(hf, name) for pattern, hf in _SHARED_RENAMES if pattern.match(name)]


def _kind(name: str) -> str:
    return "routed" if _ROUTED.match(name) else "shared" if _shared_parts(name) else "hybrid"


def to_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megacann whole tensors -> Hugging Face names."""
    by_kind: dict[str, dict[str, torch.Tensor]] = {"routed": {}, "shared": {}, "hybrid": {}}
    for name, tensor in tensors.items():
        by_kind[_kind(name)][name] = tensor
    out = hf_qwen3_5.to_hf_tensors(by_kind["hybrid"], cfg)
    out.update(experts_to_hf(by_kind["routed"], cfg, QWEN3_MOE_LAYOUT))
    for name, tensor in by_kind["shared"].items():
        parts = _shared_parts(name)
        out.update(zip(parts, (t.contiguous() for t in tensor.chunk(len(parts), dim=0))))
    return out


def from_hf_tensors(names: Sequence[str], read: hf_qwen3_5.Reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole tensors of megacann ``names``, read by Hugging Face name."""
    out = hf_qwen3_5.from_hf_tensors([n for n in names if _kind(n) == "hybrid"], read, cfg)
    out.update(experts_from_hf([n for n in names if _kind(n) == "routed"], read, cfg, QWEN3_MOE_LAYOUT))
    for name in (n for n in names if _kind(n) == "shared"):
        out[name] = torch.cat([read(part) for part in _shared_parts(name)], dim=0)
    return out


def linear_parts(name: str, cfg: ModelConfig) -> list[tuple[str, Optional[int]]]:
    """The Hugging Face names (and rows) of a megacann linear weight (PEFT adapter names; the experts' are
    Qwen3-MoE's per-expert names, which PEFT does not load here: see :func:`peft_refusal`)."""
    if _kind(name) == "routed":
        return expert_parts(name, cfg, QWEN3_MOE_LAYOUT, hf_llama.hf_parts)
    if shared := _shared_parts(name):
        return [(part, cfg.shared_expert_intermediate_size if len(shared) > 1 else None) for part in shared]
    return hf_qwen3_5.linear_parts(name, cfg)


def peft_refusal(targets: Sequence[str]) -> Optional[str]:
    """Why PEFT cannot hold LoRAs on the MLP projections of Qwen3.5-MoE / Qwen3-Next (None: none named)."""
    named = [t for t in targets if t in MLP_PROJECTIONS]
    if not named:
        return None
    return (
        f"{named} are refused for qwen3_5_moe and qwen3_next: they reach every routed expert, and PEFT (0.21, on "
        "transformers 5.25) does not load per-expert LoRAs onto these families' fused experts (they come out "
        "missing or misplaced); target the attention and Gated DeltaNet projections"
    )


def qwen3_5_moe_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a ``Qwen3_5MoeForCausalLM``: Qwen3.5's keys without the dense MLP's, and the MoE's."""
    config = hf_qwen3_5.qwen3_5_config_dict(cfg, dtype)
    config.pop("intermediate_size")
    config.update(
        architectures=["Qwen3_5MoeForCausalLM"],
        model_type="qwen3_5_moe_text",
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        router_aux_loss_coef=cfg.moe_aux_loss_coeff,
    )
    return config


def qwen3_5_moe_config_from_hf(config_file: str, raw: Optional[dict[str, Any]] = None) -> ModelConfig:
    """A qwen3_5_moe ModelConfig from config.json (what Qwen3.5 refuses refused here too)."""
    raw = read_hf_config(config_file) if raw is None else raw
    cfg = hf_llama.model_config_from_hf(config_file, family="qwen3_5_moe", raw=raw)
    for key, field_name in (("num_experts", "num_experts"), ("moe_intermediate_size", "moe_ffn_hidden_size")):
        if getattr(cfg, field_name) is None:
            raise ConfigError(f"{config_file}: {key} is needed for a Qwen3.5-MoE model")
    cfg.ffn_hidden_size = cfg.moe_ffn_hidden_size  # as the family fills it: no layer has a dense MLP
    check_qwen3_5_keys(cfg, config_file, attention_head_dim(cfg))
    return cfg


QWEN3_5_MOE_HF = HFAdapter(
    model_types=("qwen3_5_moe_text",),
    config_from_hf=qwen3_5_moe_config_from_hf,
    config_to_hf=qwen3_5_moe_config_dict,
    to_hf=to_hf_tensors,
    from_hf=from_hf_tensors,
    linear_parts=linear_parts,
    peft_refusal=peft_refusal,
)
