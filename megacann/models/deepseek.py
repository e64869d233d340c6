"""DeepSeek-V3 (``model.type: deepseek_v3``; Hugging Face ``model_type: deepseek_v3``, also Moonlight):
multi-head latent attention and DeepSeek's mixture of experts.

    tokens -> embed_tokens -> layers[i] (LatentAttention, then a dense SwiGLU MLP for i < first_k_dense_replace,
              else an MoE layer with shared experts) ... -> norm -> lm_head

- attention: :class:`megacann.layers.LatentAttention` (low-rank q and kv, decoupled RoPE of width
  ``qk_rope_head_dim``, interleaved by default as ``rope_interleave``; YaRN ``rope_scaling`` scales the
  rotary tables and the softmax as transformers does);
- routing: sigmoid scores plus a per-expert bias (a frozen parameter, read from and written to the
  checkpoint's ``e_score_correction_bias``; moved by ``moe_bias_update_rate`` when that is > 0), top
  ``moe_top_k`` among the best ``topk_group`` of ``n_group`` groups, renormalised when
  ``norm_topk_prob``, times ``routed_scaling_factor``; ``moe_shared_experts`` shared experts.

The rest (forward step, balancing, console warnings, expert parallelism) is the MoE family's
(:mod:`megacann.models.moe`), and so is multi-token prediction (config.json's
``num_nextn_predict_layers`` = ``model.mtp_num_layers``; :mod:`megacann.models.mtp`): each depth's layer is
one of the last layer's kind (latent attention and an MoE layer), stored in Hugging Face checkpoints as
decoder layer ``num_hidden_layers + k - 1``.
"""

from __future__ import annotations

import dataclasses

from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.layers import LatentAttention, MoEConfig, MoELayer, TransformerBlock, init_normal
from megacann.layers.latent_attention import latent_attention_parameters, mla_softmax_scale
from megacann.models.decode_cache import CompressedLatent, LayerCache
from megacann.models.decoder import DecoderArch, block_config
from megacann.models.deepseek_config import DeepseekV3ModelConfig, deepseek_layer_flags
from megacann.models.hf_deepseek import DEEPSEEK_V3_HF
from megacann.models.moe import (
    MoEModel,
    check_moe_config,
    is_moe_layer,
    moe_defaults,
    moe_model_spec,
    moe_structure,
)
from megacann.models.mtp import mtp_depths, mtp_parameters
from megacann.models.spec import MoEStructure


def deepseek_defaults(cfg: ModelConfig) -> None:
    """The MoE family's defaults, and the MoE layers from ``first_k_dense_replace``."""
    moe_defaults(cfg)
    if cfg.moe_layer_freq is None and cfg.num_layers:
        cfg.moe_layer_freq = deepseek_layer_flags(cfg)


def latent_attention_size(m: ModelConfig) -> int:
    """Parameters of one layer's latent attention."""
    return latent_attention_parameters(
        m.hidden_size,
        m.num_attention_heads,
        m.kv_lora_rank,
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
        m.q_lora_rank,
    )


class DeepseekV3Model(MoEModel):
    """One pipeline stage of a DeepSeek-V3 model (see the module docstring; :class:`DecoderLM` for
    forward). Attention parameters are ``layers.<i>.self_attn.{q_a_proj, q_a_layernorm, q_b_proj |
    q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``, named as Hugging Face's."""

    ARCH = DecoderArch(normalization="rmsnorm", activation="swiglu", position_embedding="rope", latent_attention=True)
    fill_defaults = staticmethod(deepseek_defaults)

    @staticmethod
    def make_block_config(cfg: ModelConfig, arch: DecoderArch):
        # the rotary tables (the model's and each block's) are of the rope part's width
        return dataclasses.replace(block_config(cfg, arch), head_dim=cfg.qk_rope_head_dim)

    def moe_config(self) -> MoEConfig:
        c = self.config
        return dataclasses.replace(
            super().moe_config(),
            normalize_top_k=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
            num_groups=c.n_group,
            top_k_groups=c.topk_group,
            expert_bias=True,
        )

    def attention_options(self) -> dict:
        """More keyword arguments of each layer's :class:`LatentAttention` (a family built on this one adds
        its own; new modules on every call)."""
        return {}

    def build_layer(self, layer_id: int) -> TransformerBlock:
        c, b = self.config, self.block_config
        attention = LatentAttention(
            c.hidden_size,
            c.num_attention_heads,
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
            q_lora_rank=c.q_lora_rank,
            norm_eps=c.norm_eps,
            softmax_scale=mla_softmax_scale(c.qk_nope_head_dim + c.qk_rope_head_dim, c.rope_scaling),
            rotary_interleaved=c.rotary_interleaved,
            attention_dropout=c.attention_dropout,
            recompute_core_attention=c.activation_checkpointing == "selective",
            init_method=init_normal(b.init_method_std),
            output_init_method=init_normal(b.output_layer_init_std),
            **self.attention_options(),
        )
        mlp = MoELayer(self.moe_config()) if is_moe_layer(c, layer_id) else None
        return TransformerBlock(b, mlp=mlp, attention=attention)


# -- recipe checks ------------------------------------------------------------------------------------


def check_deepseek_config(cfg: MegacannConfig, source: str) -> None:
    """What DeepSeek-V3 needs of a recipe, then the MoE family's checks."""
    m, d = cfg.model, cfg.distributed
    if m.add_bias_linear:
        raise ConfigError(
            f"{source}: model.add_bias_linear (config.json attention_bias) true is refused: DeepSeek-V3 has no biases"
        )
    if m.num_attention_heads % d.tensor_parallel_size:
        raise ConfigError(
            f"{source}: model.num_attention_heads {m.num_attention_heads} is not divisible by "
            f"distributed.tensor_parallel_size {d.tensor_parallel_size}"
        )
    if m.num_key_value_heads not in (None, m.num_attention_heads):
        raise ConfigError(
            f"{source}: model.num_key_value_heads {m.num_key_value_heads} must equal num_attention_heads "
            f"{m.num_attention_heads} (or be unset): latent attention expands its kv latent for every head"
        )
    if m.qk_rope_head_dim < 2 or m.qk_rope_head_dim % 2:
        raise ConfigError(f"{source}: model.qk_rope_head_dim must be a positive even number, got {m.qk_rope_head_dim}")
    if m.first_k_dense_replace < 0 or m.moe_layer_freq != deepseek_layer_flags(m):
        raise ConfigError(
            f"{source}: model.moe_layer_freq {m.moe_layer_freq!r} disagrees with first_k_dense_replace "
            f"{m.first_k_dense_replace}; family deepseek_v3 derives it: set first_k_dense_replace instead"
        )
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    for key, value, expected in (("head_dim", m.head_dim, m.qk_rope_head_dim), ("qk_head_dim", m.qk_head_dim, qk)):
        if value is not None and value != expected:
            raise ConfigError(f"{source}: model.{key} {value} must be {expected} (or unset) in family deepseek_v3")
    experts = m.num_experts or 0
    if m.n_group < 1 or experts % m.n_group or not 1 <= m.topk_group <= m.n_group:
        raise ConfigError(
            f"{source}: model.n_group {m.n_group} must divide num_experts {experts} and model.topk_group "
            f"{m.topk_group} be in [1, n_group]"
        )
    if m.moe_top_k > m.topk_group * (experts // m.n_group):
        raise ConfigError(
            f"{source}: model.moe_top_k {m.moe_top_k} exceeds the experts of topk_group {m.topk_group} groups "
            f"of {experts // m.n_group}"
        )
    if m.norm_topk_prob and m.moe_top_k == 1:
        raise ConfigError(f"{source}: model.norm_topk_prob with moe_top_k 1 is refused (the one weight would be 1)")
    if m.routed_scaling_factor <= 0:
        raise ConfigError(f"{source}: model.routed_scaling_factor must be > 0, got {m.routed_scaling_factor}")
    check_moe_config(cfg, source)


# -- sizes and FLOPs ----------------------------------------------------------------------------------


def _filled(m: ModelConfig) -> ModelConfig:
    m = dataclasses.replace(m)  # the family's defaults, the recipe left as it is
    deepseek_defaults(m)
    return m


def deepseek_num_parameters(m: ModelConfig, active: bool = False) -> int:
    """Parameters of the whole model (``active``: those one token meets: its top-k routed experts, the
    shared experts, dense layers, attention, embeddings). The routing bias is not counted (a buffer in
    transformers)."""
    m = _filled(m)
    h, attn = m.hidden_size, latent_attention_size(m)
    dense_layer = attn + 3 * h * m.ffn_size + 2 * h
    routed = m.moe_top_k if active else m.num_experts
    moe_layer = attn + 2 * h + m.num_experts * h + 3 * h * m.moe_ffn_hidden_size * (routed + m.moe_shared_experts)
    moe = sum(is_moe_layer(m, i) for i in range(m.num_layers))
    vocab = m.vocab_size or 0
    total = (m.num_layers - moe) * dense_layer + moe * moe_layer + h
    total += mtp_parameters(m, moe_layer if is_moe_layer(m, m.num_layers - 1) else dense_layer)
    return total + vocab * h * (1 if m.tie_word_embeddings else 2)


def deepseek_flops_per_token(m: ModelConfig, seq_length: int) -> float:
    """6N (N: the matrix weights a token meets, multi-token prediction's depths and their use of the head
    included) plus the attention scores and values, 6 L H (qk + v) T."""
    m = _filled(m)
    depths, h, vocab = mtp_depths(m), m.hidden_size, m.vocab_size or 0
    layers = m.num_layers + depths
    norms = layers * (2 * h + m.kv_lora_rank + (m.q_lora_rank or 0)) + h + depths * 3 * h
    embedding = vocab * h * (0 if m.tie_word_embeddings else 1)  # the input embedding: no matmul
    n = deepseek_num_parameters(m, active=True) - norms - embedding + depths * vocab * h  # MTP: the head again
    qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return 6.0 * n + 6.0 * layers * m.num_attention_heads * (qk + v) * seq_length


def deepseek_structure(m: ModelConfig) -> MoEStructure:
    return dataclasses.replace(moe_structure(_filled(m)), normalize_top_k=m.norm_topk_prob)


def deepseek_decode_cache(m: ModelConfig) -> list[LayerCache]:
    """Every layer caches its compressed latent and shared rotary key (multi-token prediction's depths
    do not run while generating)."""
    m = _filled(m)
    return [CompressedLatent(m.kv_lora_rank, m.qk_rope_head_dim)] * m.num_layers


DEEPSEEK_V3 = dataclasses.replace(  # decodes as every decoder: its latent attention layers read a latent cache
    moe_model_spec(
        "deepseek_v3",
        DeepseekV3Model,
        config_class=DeepseekV3ModelConfig,
        check_config=check_deepseek_config,
        hf=DEEPSEEK_V3_HF,
        num_parameters=deepseek_num_parameters,
        flops_per_token=deepseek_flops_per_token,
        structure=deepseek_structure,
    ),
    decode_cache=deepseek_decode_cache,
)

__all__ = ["DEEPSEEK_V3", "DeepseekV3Model", "deepseek_num_parameters"]
