"""Qwen3-Next (Hugging Face ``model_type: qwen3_next``, ``Qwen3NextForCausalLM``): Qwen3.5's hybrid layers
(:mod:`megacann.models.qwen3_5`: Gated DeltaNet or gated full attention by ``layer_types``, q/k norms,
RoPE on part of each head, norms stored around 0 by Hugging Face) with Qwen3-MoE's feed-forward layers:

- layer ``i`` has an MoE layer when ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in
  ``mlp_only_layers``, else a dense SwiGLU of width ``ffn_hidden_size`` (config.json ``intermediate_size``);
- routing: softmax over ``num_experts``, top ``moe_top_k``, renormalised when ``norm_topk_prob``; one
  shared expert of width ``shared_expert_intermediate_size`` weighed per token by a learned gate
  (:class:`~megacann.models.qwen3_5_moe.GatedSharedExpert`).

Only the checkpoint layout of the DeltaNet differs from Qwen3.5's (projections fused per key head), which
the adapter regroups exactly (:mod:`megacann.models.hf_qwen3_next`). It generates through Qwen3.5's caches
(a recurrent state a DeltaNet layer, keys and values a full-attention layer), and ``megacann-plan`` sizes it
with Qwen3.5's formulas and the MoE layers' with the gated shared expert.
"""

from __future__ import annotations

import dataclasses

import torch

from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.layers import MoEConfig, TransformerBlock
from megacann.models.hf_qwen3_next import QWEN3_NEXT_HF
from megacann.models.moe import is_moe_layer, moe_model_spec, moe_structure, num_moe_layers
from megacann.models.qwen import check_qwen3_moe_config, qwen3_moe_defaults
from megacann.models.qwen3_5 import QWEN3_5_ARCH, check_qwen3_5_config, qwen3_5_decode_cache, qwen3_5_num_parameters
from megacann.models.qwen3_5_moe import (
    Qwen35MoeModel,
    gated_moe_layer_extra_parameters,
    qwen3_5_moe_flops_per_token,
)
from megacann.models.qwen3_next_config import Qwen3NextModelConfig
from megacann.models.spec import MoEStructure


def qwen3_next_defaults(cfg: ModelConfig) -> None:
    """Qwen3-MoE's defaults (the MoE layers from ``decoder_sparse_step`` / ``mlp_only_layers``), and the
    shared expert as wide as a routed expert unless set."""
    qwen3_moe_defaults(cfg)
    if cfg.shared_expert_intermediate_size is None:
        cfg.shared_expert_intermediate_size = cfg.moe_ffn_hidden_size


class Qwen3NextModel(Qwen35MoeModel):
    """A Qwen3-Next model: Qwen3.5's token mixers; an MoE layer with a gated shared expert where Qwen3-MoE's
    rule puts one, a dense MLP elsewhere. See :class:`DecoderLM` for forward."""

    fill_defaults = staticmethod(qwen3_next_defaults)

    def moe_config(self) -> MoEConfig:
        return dataclasses.replace(super().moe_config(), normalize_top_k=self.config.norm_topk_prob)

    def build_layer(self, layer_id: int) -> torch.nn.Module:
        if is_moe_layer(self.config, layer_id):
            return super().build_layer(layer_id)
        return TransformerBlock(self.block_config, attention=self.token_mixer(layer_id))


def check_qwen3_next_config(cfg: MegacannConfig, source: str) -> None:
    """Qwen3.5's checks of the hybrid layers, Qwen3-MoE's of the MoE layers and routing, no balancing bias."""
    check_qwen3_5_config(cfg, source)
    if cfg.model.moe_bias_update_rate:
        raise ConfigError(
            f"{source}: model.moe_bias_update_rate {cfg.model.moe_bias_update_rate} is refused: Qwen3-Next's "
            "router has no balancing bias (0)"
        )
    check_qwen3_moe_config(cfg, source)


def qwen3_next_num_parameters(m: ModelConfig, active: bool = False) -> int:
    """Parameters of the whole model (``active``: those one token meets): Qwen3.5's count with the dense MLP
    of each MoE layer replaced by its router, experts, shared expert and gate."""
    m = dataclasses.replace(m)
    qwen3_next_defaults(m)
    return qwen3_5_num_parameters(m) + num_moe_layers(m) * gated_moe_layer_extra_parameters(m, active)


def qwen3_next_flops_per_token(m: ModelConfig, seq_length: int) -> float:
    """6 N (the parameters a token meets) plus the full-attention layers' 12 H Q T, as Qwen3.5-MoE's."""
    return qwen3_5_moe_flops_per_token(m, seq_length, num_parameters=qwen3_next_num_parameters)


def _structure(m: ModelConfig) -> MoEStructure:
    m = dataclasses.replace(m)
    qwen3_next_defaults(m)
    return dataclasses.replace(
        moe_structure(m),
        shared_ffn_hidden_size=m.shared_expert_intermediate_size,
        normalize_top_k=m.norm_topk_prob,
        shared_expert_gate=True,
    )


QWEN3_NEXT = dataclasses.replace(
    moe_model_spec(
        "qwen3_next",
        Qwen3NextModel,
        config_class=Qwen3NextModelConfig,
        check_config=check_qwen3_next_config,
        hf=QWEN3_NEXT_HF,
        num_parameters=qwen3_next_num_parameters,
        flops_per_token=qwen3_next_flops_per_token,
        structure=_structure,
    ),
    architecture=QWEN3_5_ARCH,
    decode_cache=qwen3_5_decode_cache,
)
