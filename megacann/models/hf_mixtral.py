"""The Hugging Face adapter of the MoE family: names and settings of ``MixtralForCausalLM`` checkpoints.

Attention, norms and embeddings are named as in LLaMA (:mod:`megacann.models.hf_llama`). An MoE layer maps as::

    layers.<i>.mlp.router.weight                   model.layers.<i>.block_sparse_moe.gate.weight
    layers.<i>.mlp.experts.<e>.gate_up_proj.weight  cat(...experts.<e>.w1.weight (gate), ...experts.<e>.w3.weight (up))
    layers.<i>.mlp.experts.<e>.down_proj.weight     model.layers.<i>.block_sparse_moe.experts.<e>.w2.weight

(the checkpoint layout transformers writes and the Hub's Mixtral checkpoints use). Mixtral is every layer
an MoE layer with softmax top-k routing (k >= 2, the chosen weights normalised), no shared experts and no
routing bias; a model of the family that is more than that cannot be written as Mixtral and is refused.
Other checkpoints that keep routers and experts the same way under other names (Qwen3-MoE) reuse the
mapping through an :class:`ExpertLayout`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megacann.config import ConfigError, ModelConfig
from megacann.models import hf_llama
from megacann.models.spec import HFAdapter

_ROUTER = re.compile(r"layers\.(\d+)\.mlp\.router\.weight")
_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_up_proj|down_proj)\.weight")
_BIAS = re.compile(r"layers\.(\d+)\.mlp\.router\.expert_bias")
DenseParts = Callable[[str, ModelConfig], list[tuple[str, Optional[int]]]]  # e.g. hf_llama.hf_parts


@dataclass(frozen=True)
class ExpertLayout:
    """Where a Hugging Face MoE checkpoint keeps an MoE layer's router and experts: ``block`` (with
    ``{layer}``) holds ``<router>.weight`` and ``experts.<e>.<gate|up|down>.weight``. Mixtral's is
    :data:`MIXTRAL_LAYOUT`; Qwen-MoE and DeepSeek name them ``mlp.gate`` and ``gate_proj / up_proj /
    down_proj``."""

    block: str
    router: str = "gate"
    gate: str = "w1"
    up: str = "w3"
    down: str = "w2"

    def router_name(self, layer: str) -> str:
        return f"{self.block.format(layer=layer)}.{self.router}.weight"

    def expert_names(self, layer: str, expert: str) -> dict[str, str]:
        base = f"{self.block.format(layer=layer)}.experts.{expert}"
        return {part: f"{base}.{getattr(self, part)}.weight" for part in ("gate", "up", "down")}


MIXTRAL_LAYOUT = ExpertLayout("model.layers.{layer}.block_sparse_moe")


def expert_parts(
    name: str, cfg: ModelConfig, layout: ExpertLayout, dense: DenseParts
) -> list[tuple[str, Optional[int]]]:
    """The Hugging Face names of megacann weight ``name`` with the output rows of each (rows None: the
    whole tensor): an expert's gate_up_proj is gate then up, its down_proj down; other weights as
    ``dense`` says. What PEFT adapter names need (``HFAdapter.linear_parts``)."""
    if match := _EXPERT.fullmatch(name):
        hf = layout.expert_names(match[1], match[2])
        if match[3] == "down_proj":
            return [(hf["down"], None)]
        return [(hf["gate"], cfg.moe_ffn_hidden_size), (hf["up"], cfg.moe_ffn_hidden_size)]
    return dense(name, cfg)


def experts_to_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig, layout: ExpertLayout) -> dict[str, torch.Tensor]:
    """megacann whole tensors of an MoE decoder -> Hugging Face names: routers and experts under
    ``layout``'s names (gate/up split), the rest as LLaMA's. A router's balancing bias must be zero."""
    out: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if _BIAS.fullmatch(name):  # a zero bias (balancing off) carries nothing
            if torch.count_nonzero(tensor):
                raise ConfigError(f"{name} is not zero: the Hugging Face model has no routing bias")
        elif match := _ROUTER.fullmatch(name):
            out[layout.router_name(match[1])] = tensor
        elif match := _EXPERT.fullmatch(name):
            hf = layout.expert_names(match[1], match[2])
            if match[3] == "down_proj":
                out[hf["down"]] = tensor
            else:
                out[hf["gate"]], out[hf["up"]] = torch.split(tensor, [cfg.moe_ffn_hidden_size] * 2, dim=0)
        else:
            rest[name] = tensor
    out.update(hf_llama.to_hf_tensors(rest, cfg))
    return {k: v.contiguous() for k, v in out.items()}


def experts_from_hf(
    names: Sequence[str], read: Callable[[str], torch.Tensor], cfg: ModelConfig, layout: ExpertLayout
) -> dict[str, torch.Tensor]:
    """The whole tensors of an MoE decoder's megacann ``names``: routers and experts read by ``layout``'s
    names, the rest as LLaMA's."""
    out: dict[str, torch.Tensor] = {}
    rest = []
    for name in names:
        if match := _ROUTER.fullmatch(name):
            out[name] = read(layout.router_name(match[1]))
        elif match := _EXPERT.fullmatch(name):
            hf = layout.expert_names(match[1], match[2])
            out[name] = read(hf["down"]) if match[3] == "down_proj" else torch.cat([read(hf["gate"]), read(hf["up"])])
        else:
            rest.append(name)
    out.update(hf_llama.from_hf_tensors(rest, read, cfg))
    return out


def check_mixtral_compatible(cfg: ModelConfig) -> None:
    """Refuse what a Mixtral checkpoint cannot express, naming the key."""
    freq = cfg.moe_layer_freq
    all_moe = freq == 1 or (isinstance(freq, list) and all(freq))
    problems = {
        "moe_layer_freq": (not all_moe, "every layer must be an MoE layer (1)"),
        "moe_shared_experts": (cfg.moe_shared_experts != 0, "Mixtral has no shared experts (0)"),
        "moe_router": (cfg.moe_router != "softmax", "Mixtral routes by softmax"),
        "moe_top_k": (cfg.moe_top_k < 2, "Mixtral normalises the chosen weights, which needs top_k >= 2"),
        "moe_bias_update_rate": (cfg.moe_bias_update_rate != 0, "Mixtral has no routing bias (0)"),
        "add_bias_linear": (bool(cfg.add_bias_linear), "Mixtral has no biases (false)"),
    }
    for key, (bad, why) in problems.items():
        if bad:
            raise ConfigError(f"model.{key} {getattr(cfg, key)!r} cannot be written as Mixtral: {why}")


def hf_parts(name: str, cfg: ModelConfig) -> list[tuple[str, Optional[int]]]:
    """The Mixtral names of megacann weight ``name`` with the output rows of each: an expert's
    gate_up_proj is w1 (gate) then w3 (up), its down_proj w2; the rest as in LLaMA."""
    check_mixtral_compatible(cfg)
    return expert_parts(name, cfg, MIXTRAL_LAYOUT, hf_llama.hf_parts)


def to_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megacann whole tensors -> Mixtral names (gate/up split; router and experts renamed)."""
    check_mixtral_compatible(cfg)
    return experts_to_hf(tensors, cfg, MIXTRAL_LAYOUT)


def from_hf_tensors(
    names: Sequence[str], read: Callable[[str], torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """The whole tensors of megacann ``names``, read by Mixtral name through ``read(hf_name)``."""
    return experts_from_hf(names, read, cfg, MIXTRAL_LAYOUT)


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    check_mixtral_compatible(cfg)
    config = hf_llama.hf_config_dict(cfg, dtype)
    for key in ("mlp_bias", "attention_bias"):
        config.pop(key)
    config.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=cfg.moe_ffn_hidden_size,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        router_aux_loss_coef=cfg.moe_aux_loss_coeff,
        sliding_window=None,
    )
    return config


def model_config_from_hf(config_file: str, raw: Optional[dict[str, Any]] = None) -> ModelConfig:
    """An MoE-family ModelConfig from a Mixtral config.json (experts as wide as ``intermediate_size``)."""
    cfg = hf_llama.model_config_from_hf(config_file, family="moe", raw=raw)
    cfg.moe_ffn_hidden_size = cfg.ffn_hidden_size
    if cfg.num_experts is None:
        raise ConfigError(f"{config_file}: num_local_experts is missing (a Mixtral config names its experts)")
    return cfg


MIXTRAL_HF = HFAdapter(
    model_types=("mixtral",),
    config_from_hf=model_config_from_hf,
    config_to_hf=hf_config_dict,
    to_hf=to_hf_tensors,
    from_hf=from_hf_tensors,
    linear_parts=hf_parts,
)
