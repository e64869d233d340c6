"""Qwen3.5-MoE (Hugging Face ``model_type: qwen3_5_moe_text``, ``Qwen3_5MoeForCausalLM``): Qwen3.5's hybrid
layers (:mod:`megacann.models.qwen3_5`) with an MoE layer in every layer.

- routing: softmax over all ``num_experts`` experts, the top ``moe_top_k`` renormalised (always, as
  transformers does); SwiGLU experts of width ``moe_ffn_hidden_size``;
- one shared expert, a SwiGLU of width ``shared_expert_intermediate_size``, whose output each token weighs
  by ``sigmoid(x · g)`` (``g``: one learned row, :class:`GatedSharedExpert`).

Hugging Face checkpoints convert both ways (:mod:`megacann.models.hf_qwen3_5_moe`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.layers import MoEConfig, MoELayer, TransformerBlock, init_normal, make_parameter
from megacann.layers.context import resolve_sequence_parallel
from megacann.layers.sharding import mark_partial_grad
from megacann.models import sizing
from megacann.models.hf_qwen3_5_moe import QWEN3_5_MOE_HF
from megacann.models.moe import MoEModel, check_moe_config, moe_defaults, moe_model_spec, moe_structure
from megacann.models.qwen3_5 import (
    QWEN3_5_ARCH,
    HybridLayers,
    check_qwen3_5_config,
    qwen3_5_decode_cache,
    qwen3_5_num_parameters,
)
from megacann.models.qwen3_5_config import LINEAR, Qwen35MoeModelConfig, qwen3_5_layer_types
from megacann.models.spec import MoEStructure


class GatedSharedExpert(torch.nn.Module):
    """``sigmoid(x · gate_weight) · expert(x)``: a shared expert whose output each token weighs by a learned
    gate (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE). The gate row is whole on every rank; under sequence
    parallelism each rank's tokens give part of its gradient (summed over TP)."""

    def __init__(
        self, expert: torch.nn.Module, hidden_size: int, init_method, sequence_parallel: Optional[bool] = None
    ):
        super().__init__()
        self.expert = expert
        weight = expert.down_proj.weight
        self.gate_weight = make_parameter(
            (1, hidden_size), init_method, tp_rank=0, tp_size=1, name="shared expert gate",
            dtype=weight.dtype, device=weight.device,
        )  # fmt: skip
        if resolve_sequence_parallel(sequence_parallel):
            mark_partial_grad(self.gate_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.gate_weight)) * self.expert(x)


def qwen3_5_moe_defaults(cfg: ModelConfig) -> None:
    """The MoE family's defaults; ``ffn_hidden_size`` (no layer has a dense MLP) and the shared expert as
    wide as a routed expert unless set."""
    if cfg.ffn_hidden_size is None:
        cfg.ffn_hidden_size = cfg.moe_ffn_hidden_size
    moe_defaults(cfg)
    if cfg.shared_expert_intermediate_size is None:
        cfg.shared_expert_intermediate_size = cfg.moe_ffn_hidden_size


class Qwen35MoeModel(HybridLayers, MoEModel):
    """A Qwen3.5-MoE model: Qwen3.5's token mixers, an MoE layer with a gated shared expert in every layer.
    See :class:`DecoderLM` for forward."""

    ARCH = QWEN3_5_ARCH
    fill_defaults = staticmethod(qwen3_5_moe_defaults)

    def moe_config(self) -> MoEConfig:
        shared = self.config.shared_expert_intermediate_size
        return dataclasses.replace(
            super().moe_config(), normalize_top_k=True, num_shared_experts=1, shared_expert_ffn_hidden_size=shared
        )

    def build_layer(self, layer_id: int) -> torch.nn.Module:
        moe = MoELayer(self.moe_config())
        std = self.block_config.init_method_std
        moe.shared_experts = GatedSharedExpert(moe.shared_experts, self.config.hidden_size, init_normal(std))
        return TransformerBlock(self.block_config, attention=self.token_mixer(layer_id), mlp=moe)


def check_qwen3_5_moe_config(cfg: MegacannConfig, source: str) -> None:
    """Qwen3.5's checks, the routing Qwen3.5-MoE has, then the MoE family's checks."""
    check_qwen3_5_config(cfg, source)
    m = cfg.model
    if m.moe_layer_freq != 1 or m.moe_shared_experts or m.moe_router != "softmax" or m.moe_bias_update_rate:
        raise ConfigError(
            f"{source}: model.moe_layer_freq {m.moe_layer_freq!r} / moe_shared_experts {m.moe_shared_experts} / "
            f"moe_router {m.moe_router!r} / moe_bias_update_rate {m.moe_bias_update_rate}: Qwen3.5-MoE has an MoE "
            "layer in every layer, softmax routing, its one gated shared expert (shared_expert_intermediate_size) "
            "and no balancing bias (1, 0, softmax, 0)"
        )
    check_moe_config(cfg, source)


def gated_moe_layer_extra_parameters(m: ModelConfig, active: bool = False) -> int:
    """What one MoE layer adds over a dense MLP of width ``ffn_size``: the router, the experts (all, or the
    top ``moe_top_k``), the shared expert and its gate, less the dense MLP (``m``'s defaults filled)."""
    h, experts = m.hidden_size, m.moe_top_k if active else m.num_experts
    moe = m.num_experts * h + 3 * h * (experts * m.moe_ffn_hidden_size + m.shared_expert_intermediate_size) + h
    return moe - QWEN3_5_ARCH.mlp_matrices * h * m.ffn_size


def qwen3_5_moe_num_parameters(m: ModelConfig, active: bool = False) -> int:
    """Parameters of the whole model (``active``: those one token meets): Qwen3.5's count with each dense
    MLP replaced by the router, the experts (all, or the top ``moe_top_k``), the shared expert and its gate."""
    m = dataclasses.replace(m)
    qwen3_5_moe_defaults(m)
    return qwen3_5_num_parameters(m) + m.num_layers * gated_moe_layer_extra_parameters(m, active)


def qwen3_5_moe_flops_per_token(
    m: ModelConfig, seq_length: int, num_parameters: Callable[..., int] = qwen3_5_moe_num_parameters
) -> float:
    """6 N (N: the parameters a token meets by ``num_parameters``, its top-k experts and the shared one; the
    embedding, norms and vectors, a small part, counted too) plus the full-attention layers' 12 H Q T; the
    delta rule's own work is not counted."""
    full = m.num_layers - qwen3_5_layer_types(m).count(LINEAR)
    attention = 12.0 * full * m.num_attention_heads * sizing.attention_head_dim(m) * seq_length
    return 6.0 * num_parameters(m, active=True) + attention


def _structure(m: ModelConfig) -> MoEStructure:
    m = dataclasses.replace(m)
    qwen3_5_moe_defaults(m)
    shared = m.shared_expert_intermediate_size
    return dataclasses.replace(moe_structure(m), shared_ffn_hidden_size=shared, shared_expert_gate=True)


QWEN3_5_MOE = dataclasses.replace(
    moe_model_spec(
        "qwen3_5_moe",
        Qwen35MoeModel,
        config_class=Qwen35MoeModelConfig,
        check_config=check_qwen3_5_moe_config,
        hf=QWEN3_5_MOE_HF,
        num_parameters=qwen3_5_moe_num_parameters,
        flops_per_token=qwen3_5_moe_flops_per_token,
        structure=_structure,
    ),
    architecture=QWEN3_5_ARCH,
    decode_cache=qwen3_5_decode_cache,
)
