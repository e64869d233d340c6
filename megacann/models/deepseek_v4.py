"""DeepSeek-V4 (``model.type: deepseek_v4``; Hugging Face ``model_type: deepseek_v4``): hyper-connected
residual streams, compressed sparse attention and hash-routed experts.

    tokens -> embed_tokens -> hc_mult streams -> layers[i] (DeepseekV4Block) ... -> hc_head -> norm -> lm_head

Each :class:`DeepseekV4Block` keeps the residual as ``hc_mult`` streams ``[b, s, n, h]``. Around the
attention and around the MoE layer a :class:`~megacann.layers.HyperConnection` collapses the streams into
the block's input (normed by ``input_layernorm`` / ``post_attention_layernorm``) and mixes its output back
into them. Every layer is an MoE layer: ``mlp_layer_types`` says whether it routes by its scores (``moe``:
``scoring_func`` top-k with a correction bias, renormalised, times ``routed_scaling_factor``) or by the
token's id (``hash_moe``: a fixed table, ``router.token_to_experts``), so the token ids go to every layer;
routed and shared experts apply the clamped SwiGLU of ``swiglu_limit``. A :class:`~megacann.layers.HyperHead`
collapses the streams before the final norm.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megacann.config import ModelConfig
from megacann.layers import HyperConnection, MoEConfig, MoELayer, RMSNorm
from megacann.layers.moe import ExpertActivation
from megacann.models.deepseek_v4_config import CSA, HASH_MOE, HCA, v4_compress_rates, v4_layer_types, v4_mlp_layer_types


def v4_expert_activation(cfg: ModelConfig) -> ExpertActivation:
    """DeepSeek-V4's clamped SwiGLU, ``silu(min(gate, limit)) · clamp(up, ±limit)``."""
    return ExpertActivation("clamped_swiglu", cfg.swiglu_limit, alpha=1.0, up_shift=0.0)


def is_hash_routed(cfg: ModelConfig, layer_id: int) -> bool:
    return v4_mlp_layer_types(cfg)[layer_id] == HASH_MOE


def v4_moe_config(cfg: ModelConfig, layer_id: int, base: MoEConfig) -> MoEConfig:
    """Layer ``layer_id``'s MoE settings: ``base`` (the MoE family's, from the recipe) with DeepSeek-V4's
    routing (``scoring_func`` scores, always renormalised, a correction bias, or the hash table of
    ``vocab_size`` rows on ``hash_moe`` layers) and the clamped SwiGLU."""
    hashed = is_hash_routed(cfg, layer_id)
    return dataclasses.replace(
        base,
        score_function=cfg.moe_router,
        normalize_top_k=True,
        routed_scaling_factor=cfg.routed_scaling_factor,
        activation=v4_expert_activation(cfg),
        hash_vocab_size=cfg.vocab_size if hashed else 0,
        expert_bias=not hashed,
        bias_update_rate=0.0 if hashed else base.bias_update_rate,
    )


class DeepseekV4Block(torch.nn.Module):
    """One decoder layer: ``forward(streams [b, s, n, h], token_ids [b, s], position_ids, segment_ids) ->
    streams``. ``attention`` is called as ``attention(x, position_ids, segment_ids)``; ``mlp`` as
    ``mlp(x, token_ids)`` (the ids of the tokens of ``x``: this rank's share under sequence parallelism).
    Parameters besides theirs: ``attn_hc.*``, ``ffn_hc.*`` (fp32), ``input_layernorm.weight``,
    ``post_attention_layernorm.weight`` (transformers' names)."""

    def __init__(
        self,
        attention: torch.nn.Module,
        mlp: MoELayer,
        hidden_size: int,
        num_streams: int,
        sinkhorn_iterations: int,
        hc_eps: float,
        norm_eps: float,
        init_std: float,
    ):
        super().__init__()
        mixing = dict(eps=hc_eps, norm_eps=norm_eps, init_std=init_std, dtype=torch.float32)
        self.attn_hc = HyperConnection(hidden_size, num_streams, sinkhorn_iterations, **mixing)
        self.input_layernorm = RMSNorm(hidden_size, norm_eps)
        self.self_attn = attention
        self.ffn_hc = HyperConnection(hidden_size, num_streams, sinkhorn_iterations, **mixing)
        self.post_attention_layernorm = RMSNorm(hidden_size, norm_eps)
        self.mlp = mlp

    def forward(
        self,
        streams: torch.Tensor,
        token_ids: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor] = None,
        segment_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        attended = self.self_attn(self.input_layernorm(x), position_ids, segment_ids)
        streams = HyperConnection.mix(streams, attended, post, comb)
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.mix(streams, self.mlp(self.post_attention_layernorm(x), token_ids), post, comb)


# -- sizes --------------------------------------------------------------------------------------------


def _compressor_parameters(h: int, width: int, rate: int, overlap: bool) -> int:
    """A window compressor of entries ``width`` wide: position bias, kv and gate projections (twice as
    wide with overlapping windows), the entries' norm."""
    out = 2 * width if overlap else width
    return rate * out + 2 * out * h + width


def v4_attention_parameters(m: ModelConfig, layer_type: str) -> int:
    """Parameters of one layer's attention of kind ``layer_type`` (transformers' ``DeepseekV4Attention``)."""
    h, heads, d, q = m.hidden_size, m.num_attention_heads, m.head_dim, m.q_lora_rank
    width = heads * d
    local = h * q + q + q * width + h * d + d + width * m.o_lora_rank + m.o_groups * m.o_lora_rank * h + heads
    if layer_type == HCA:
        return local + _compressor_parameters(h, d, v4_compress_rates(m)[HCA], overlap=False)
    if layer_type == CSA:
        rate, ih = v4_compress_rates(m)[CSA], m.index_head_dim
        indexer = _compressor_parameters(h, ih, rate, overlap=True) + q * m.index_n_heads * ih + m.index_n_heads * h
        return local + _compressor_parameters(h, d, rate, overlap=True) + indexer
    return local


def _mixing_parameters(m: ModelConfig) -> int:
    """One HyperConnection's parameters: ``fn``, ``base``, ``scale``."""
    n = m.hc_mult
    return (2 + n) * n * (n * m.hidden_size + 1) + 3


def deepseek_v4_num_parameters(m: ModelConfig, active: bool = False) -> int:
    """Parameters of the whole model (``active``: those one token meets: its top-k routed experts). The
    routing bias and the hash table are buffers (not counted, as in transformers)."""
    h, n, ffn = m.hidden_size, m.hc_mult, m.moe_ffn_hidden_size
    experts = m.moe_top_k if active else m.num_experts
    per_layer_moe = m.num_experts * h + 3 * h * ffn * (experts + m.moe_shared_experts)
    total = 0
    for kind in v4_layer_types(m):
        total += v4_attention_parameters(m, kind) + 2 * _mixing_parameters(m) + 2 * h + per_layer_moe
    head = n * (n * h + 1) + 1  # HyperHead
    return total + head + h + (m.vocab_size or 0) * h * (1 if m.tie_word_embeddings else 2)
