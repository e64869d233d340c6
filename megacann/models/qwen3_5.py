"""Qwen3.5 (Hugging Face ``model_type: qwen3_5_text``, ``Qwen3_5ForCausalLM``): a decoder whose layers mix
Gated DeltaNet linear attention with gated full attention.

- ``layer_types`` makes each layer ``linear_attention`` (:class:`~megacann.layers.GatedDeltaNet`: no
  positions, a recurrent state) or ``full_attention`` (:class:`~megacann.layers.SelfAttention` with q/k
  RMSNorms, heads of width ``head_dim``, ``output_gate``: q_proj also gives a gate, the heads' output times
  its sigmoid; RoPE on the first ``partial_rotary_factor`` of each head);
- every layer a dense SwiGLU MLP, pre-norm RMSNorms. Hugging Face's RMSNorms outside the DeltaNet
  multiply by ``1 + weight`` (weights stored around 0); megacann keeps the factor itself (around 1), the
  adapter adding or removing the 1 (:mod:`megacann.models.hf_qwen3_5`), so the same function is computed.

Under context parallelism the full-attention layers run the recipe's algorithm and the DeltaNet layers
hand their recurrent state and convolution inputs from rank to rank. Generation decodes as every decoder
does: the Gated DeltaNet layers keep a recurrent state and convolution tail a row
(:mod:`megacann.generation.recurrent_cache`), the full-attention layers keys and values.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.layers import GatedDeltaNet, TransformerBlock, TransformerBlockConfig, init_normal
from megacann.models import sizing
from megacann.models.decode_cache import KeysValues, LayerCache, RecurrentState
from megacann.models.decoder import DecoderArch, block_config, decoder_model_spec
from megacann.models.hf_qwen3_5 import QWEN3_5_HF
from megacann.models.llama import LlamaModel
from megacann.models.qwen3_5_config import (
    LINEAR,
    Qwen35ModelConfig,
    check_qwen3_5_keys,
    qwen3_5_layer_types,
    rotary_dims,
)


def linear_attention_layers(cfg: ModelConfig) -> list[bool]:
    """Whether each layer is a Gated DeltaNet (``layer_types``), for the memory planner."""
    return [kind == LINEAR for kind in qwen3_5_layer_types(cfg)]


QWEN3_5_ARCH = DecoderArch(
    normalization="rmsnorm",
    activation="swiglu",
    position_embedding="rope",
    qk_norm=True,
    attention_output_gate=True,
    partial_rotary=True,
    linear_attention_layers=linear_attention_layers,
)


class LinearAttentionMixer(GatedDeltaNet):
    """A :class:`GatedDeltaNet` called as a block's attention is: ``(hidden, rotary, segment_ids)``; it
    takes no positions, so the rotary tables are ignored."""

    def forward(self, hidden: torch.Tensor, rotary=None, segment_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        return super().forward(hidden, segment_ids)


class HybridLayers:
    """What the Qwen3.5 families' models share (mixed into a :class:`DecoderLM`): the gated full-attention
    blocks, RoPE on part of each head, and each layer's token mixer by ``layer_types``."""

    @staticmethod
    def make_block_config(cfg: ModelConfig, arch: DecoderArch) -> TransformerBlockConfig:
        return dataclasses.replace(block_config(cfg, arch), attention_output_gate=True)

    def rotary_width(self) -> int:
        return rotary_dims(self.config, self.block_config.attention_head_dim)

    def token_mixer(self, layer_id: int) -> Optional[torch.nn.Module]:
        """Layer ``layer_id``'s Gated DeltaNet, or None for a full-attention layer (the block's own)."""
        if qwen3_5_layer_types(self.config)[layer_id] != LINEAR:
            return None
        cfg, block = self.config, self.block_config
        return LinearAttentionMixer(
            cfg.hidden_size,
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim,
            cfg.norm_eps,
            init_method=init_normal(block.init_method_std),
            output_init_method=init_normal(block.output_layer_init_std),
        )


class Qwen35Model(HybridLayers, LlamaModel):
    """A Qwen3.5 model: linear or gated full attention by ``layer_types``, dense MLPs (LLaMA's defaults).
    See :class:`DecoderLM` for forward."""

    ARCH = QWEN3_5_ARCH

    def build_layer(self, layer_id: int) -> torch.nn.Module:
        return TransformerBlock(self.block_config, attention=self.token_mixer(layer_id))


def check_qwen3_5_config(cfg: MegacannConfig, source: str) -> None:
    """Qwen3.5's keys, the linear key heads divisible by TP."""
    m = cfg.model
    check_qwen3_5_keys(m, source, sizing.attention_head_dim(m))
    tp = cfg.distributed.tensor_parallel_size
    if LINEAR in qwen3_5_layer_types(m) and m.linear_num_key_heads % tp:
        raise ConfigError(
            f"{source}: model.linear_num_key_heads {m.linear_num_key_heads} is not divisible by "
            f"distributed.tensor_parallel_size {tp}"
        )


def linear_attention_parameters(m: ModelConfig) -> int:
    """One Gated DeltaNet: q|k|v, z, b, a and output projections, the convolution, dt_bias, A_log, norm."""
    keys, values = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    channels = 2 * keys + values
    projections = m.hidden_size * (channels + values + 2 * m.linear_num_value_heads) + values * m.hidden_size
    return projections + channels * m.linear_conv_kernel_dim + 2 * m.linear_num_value_heads + m.linear_value_head_dim


def full_attention_parameters(m: ModelConfig) -> int:
    """One gated full attention: the shared count plus the gate's rows of q_proj."""
    gate = m.hidden_size * m.num_attention_heads * sizing.attention_head_dim(m)
    return sizing.attention_parameters(m, QWEN3_5_ARCH) + gate


def qwen3_5_num_parameters(m: ModelConfig) -> int:
    """Parameters of the whole model: the decoder count with each layer's own token mixer."""
    linear = qwen3_5_layer_types(m).count(LINEAR)
    dense_attention = m.num_layers * sizing.attention_parameters(m, QWEN3_5_ARCH)
    mixers = linear * linear_attention_parameters(m) + (m.num_layers - linear) * full_attention_parameters(m)
    return sizing.num_parameters(m, QWEN3_5_ARCH) - dense_attention + mixers


def qwen3_5_flops_per_token(m: ModelConfig, seq_length: int) -> float:
    """6 N (matrix-multiply parameters: every layer's mixer and MLP, the head) plus the full-attention
    layers' 12 H Q T; the delta rule's own work, linear in the sequence, is not counted."""
    linear = qwen3_5_layer_types(m).count(LINEAR)
    mlp = QWEN3_5_ARCH.mlp_matrices * m.hidden_size * m.ffn_size
    gate = m.hidden_size * m.num_attention_heads * sizing.attention_head_dim(m)
    full = sizing.attention_matmul_parameters(m) + gate
    n = linear * linear_attention_parameters(m) + (m.num_layers - linear) * full + m.num_layers * mlp
    n += (m.vocab_size or 0) * m.hidden_size
    attention = 12.0 * (m.num_layers - linear) * m.num_attention_heads * sizing.attention_head_dim(m) * seq_length
    return 6.0 * n + attention


def qwen3_5_decode_cache(m: ModelConfig) -> list[LayerCache]:
    """A Gated DeltaNet layer keeps its recurrent state and convolution tail, a full-attention layer keys
    and values (the Qwen3.5 families' and Qwen3-Next's layers alike)."""
    keys, values = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    linear = RecurrentState(
        m.linear_num_value_heads,
        m.linear_key_head_dim,
        m.linear_value_head_dim,
        2 * keys + values,
        m.linear_conv_kernel_dim,
    )
    full = KeysValues(m.kv_heads, sizing.attention_head_dim(m), m.num_attention_heads)
    return [linear if kind == LINEAR else full for kind in qwen3_5_layer_types(m)]


QWEN3_5 = dataclasses.replace(
    decoder_model_spec("qwen3_5", Qwen35Model, check_config=check_qwen3_5_config, hf=QWEN3_5_HF),
    config_class=Qwen35ModelConfig,
    num_parameters=qwen3_5_num_parameters,
    flops_per_token=qwen3_5_flops_per_token,
    architecture=QWEN3_5_ARCH,
    decode_cache=qwen3_5_decode_cache,
)
