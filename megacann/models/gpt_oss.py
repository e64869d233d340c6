"""gpt-oss (Hugging Face ``model_type: gpt_oss``): a mixture-of-experts decoder with attention sinks.

- attention: q, k, v and output biases (``attention_bias``), heads of width ``head_dim``, and one learned
  sink logit per head joining every query's softmax (:class:`~megacann.layers.SelfAttention`'s ``sinks``);
  ``layer_types`` makes each layer ``sliding_attention`` (its last ``sliding_window`` keys) or
  ``full_attention``; rotary positions with YaRN scaling (``rope_parameters``);
- every feed-forward block an MoE layer: a router with a bias (top ``moe_top_k`` experts, weighted by a
  softmax over the chosen: the same as megacann's softmax over all then renormalised), experts with
  biases on both projections and the clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``;
  :func:`megacann.layers.moe.clamped_swiglu`).

Under context parallelism every algorithm carries the sinks (ring, all-gather and Ulysses). Hugging Face
checkpoints convert both ways (:mod:`megacann.models.hf_gpt_oss`).
"""

from __future__ import annotations

import dataclasses

import torch

from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.layers import MoEConfig, MoELayer, TransformerBlock, TransformerBlockConfig
from megacann.layers.moe import ExpertActivation
from megacann.models import sizing
from megacann.models.decode_cache import KeysValues, LayerCache
from megacann.models.decoder import DecoderArch, block_config
from megacann.models.gpt_oss_config import SLIDING, GptOssModelConfig, check_gpt_oss_keys, gpt_oss_layer_types
from megacann.models.hf_gpt_oss import GPT_OSS_HF
from megacann.models.moe import (
    MoEModel,
    check_moe_config,
    moe_defaults,
    moe_model_spec,
    moe_num_parameters,
    moe_structure,
)

GPT_OSS_ARCH = DecoderArch(
    normalization="rmsnorm", activation="swiglu", position_embedding="rope", attention_sinks=True
)


def gpt_oss_defaults(cfg: ModelConfig) -> None:
    """Attention biases on (transformers' default), then the MoE family's defaults."""
    if cfg.add_bias_linear is None:
        cfg.add_bias_linear = True
    moe_defaults(cfg)


class GptOssModel(MoEModel):
    """A gpt-oss model: every layer attention with sinks (sliding or full, by ``layer_types``) and an MoE
    layer with biases and the clamped SwiGLU. See :class:`DecoderLM` for forward."""

    ARCH = GPT_OSS_ARCH
    fill_defaults = staticmethod(gpt_oss_defaults)

    @staticmethod
    def make_block_config(cfg: ModelConfig, arch: DecoderArch) -> TransformerBlockConfig:
        return dataclasses.replace(block_config(cfg, arch), attention_sinks=True)

    def moe_config(self) -> MoEConfig:
        cfg = self.config
        activation = ExpertActivation("clamped_swiglu", cfg.swiglu_limit, cfg.swiglu_alpha)
        return dataclasses.replace(
            super().moe_config(), router_bias=True, expert_linear_bias=True, activation=activation
        )

    def build_layer(self, layer_id: int) -> torch.nn.Module:
        sliding = gpt_oss_layer_types(self.config)[layer_id] == SLIDING
        block = dataclasses.replace(self.block_config, sliding_window=self.config.sliding_window if sliding else None)
        return TransformerBlock(block, mlp=MoELayer(self.moe_config()))


def check_gpt_oss_config(cfg: MegacannConfig, source: str) -> None:
    """gpt-oss's keys, every layer MoE, then the MoE family's checks."""
    m = cfg.model
    check_gpt_oss_keys(m, source)
    if m.moe_layer_freq != 1 or m.moe_shared_experts or m.moe_router != "softmax" or m.moe_bias_update_rate:
        raise ConfigError(
            f"{source}: model.moe_layer_freq {m.moe_layer_freq!r} / moe_shared_experts {m.moe_shared_experts} / "
            f"moe_router {m.moe_router!r} / moe_bias_update_rate {m.moe_bias_update_rate}: gpt-oss has an MoE "
            "layer in every layer, softmax routing, no shared experts and no balancing bias (1, 0, softmax, 0)"
        )
    check_moe_config(cfg, source)


def gpt_oss_num_parameters(m: ModelConfig, active: bool = False) -> int:
    """Parameters of the whole model (``active``: those one token meets): the MoE family's count with
    gpt-oss's attention biases, plus the sinks, router biases and expert biases."""
    m = dataclasses.replace(m)
    gpt_oss_defaults(m)
    experts = m.moe_top_k if active else m.num_experts
    extra = m.num_attention_heads + m.num_experts + experts * (2 * m.moe_ffn_hidden_size + m.hidden_size)
    return moe_num_parameters(m, active, GptOssModel) + m.num_layers * extra


def gpt_oss_decode_cache(m: ModelConfig) -> list[LayerCache]:
    """Keys and values in every layer, a sliding layer's only for its last ``sliding_window`` tokens."""
    full = KeysValues(m.kv_heads, sizing.attention_head_dim(m), m.num_attention_heads)
    sliding = dataclasses.replace(full, window=m.sliding_window)
    return [sliding if kind == SLIDING else full for kind in gpt_oss_layer_types(m)]


GPT_OSS = dataclasses.replace(  # decodes as every decoder: the cache's attention takes the sinks
    moe_model_spec(
        "gpt_oss",
        GptOssModel,
        config_class=GptOssModelConfig,
        check_config=check_gpt_oss_config,
        hf=GPT_OSS_HF,
        num_parameters=gpt_oss_num_parameters,
        structure=lambda m: dataclasses.replace(
            moe_structure(m), router_bias=True, expert_bias=True, clamped_activation=True
        ),
    ),
    decode_cache=gpt_oss_decode_cache,
)
