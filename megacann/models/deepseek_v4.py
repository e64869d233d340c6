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
collapses the streams before the final norm. Pipeline stages pass the streams flattened, ``[b, s, hc_mult ·
h]`` (``stage_hidden_size``), and every stage reads the token ids. Context parallelism runs by all-gather
only (:mod:`megacann.layers.compressed_context_parallel`); the rest of the block works token by token.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.config.validation import require_context_parallel_algo
from megacann.layers import HyperConnection, HyperHead, MoEConfig, MoELayer, RMSNorm, init_normal, mappings
from megacann.layers.compressed_attention import CompressedSparseAttention
from megacann.layers.compressed_context_parallel import COMPRESSED_CONTEXT_PARALLEL_ALGO
from megacann.layers.hyper_connections import expand_streams
from megacann.layers.moe import ExpertActivation
from megacann.layers.random import checkpoint
from megacann.models.decode_cache import CompressedWindow, LayerCache
from megacann.models.decoder import DecoderArch, decoder_decode_step
from megacann.models.deepseek_v4_config import (
    CSA,
    HASH_MOE,
    HCA,
    SLIDING,
    DeepseekV4ModelConfig,
    check_deepseek_v4_keys,
    rope_head_dim,
    v4_compress_rates,
    v4_layer_types,
    v4_mlp_layer_types,
)
from megacann.models.deepseek_v4_memory import V4_ACTIVATIONS
from megacann.models.hf_deepseek_v4 import DEEPSEEK_V4_HF
from megacann.models.moe import MoEModel, check_moe_config, moe_defaults, moe_model_spec
from megacann.models.spec import RankParameterFormulas


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
    ``post_attention_layernorm.weight`` (transformers' names). ``recompute="full"``: while training, the
    block keeps only its input and recomputes the rest in backward."""

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
        recompute: str = "none",
    ):
        super().__init__()
        self.recompute = recompute
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
        if self.recompute == "full" and self.training:
            return checkpoint(self._forward, streams, token_ids, position_ids, segment_ids)
        return self._forward(streams, token_ids, position_ids, segment_ids)

    def _forward(
        self,
        streams: torch.Tensor,
        token_ids: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        segment_ids: Optional[torch.Tensor],
    ) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        attended = self.self_attn(self.input_layernorm(x), position_ids, segment_ids)
        streams = HyperConnection.mix(streams, attended, post, comb)
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.mix(streams, self.mlp(self.post_attention_layernorm(x), token_ids), post, comb)


# -- sizes --------------------------------------------------------------------------------------------


def _compressor_out(width: int, overlap: bool) -> int:
    """The width of a window compressor's kv and gate projections each (two series with overlapping windows)."""
    return 2 * width if overlap else width


def _compressor_parameters(h: int, width: int, rate: int, overlap: bool) -> int:
    """A window compressor of entries ``width`` wide: position bias, kv and gate projections, the entries'
    norm."""
    out = _compressor_out(width, overlap)
    return rate * out + 2 * out * h + width


def deepseek_v4_decode_cache(m: ModelConfig) -> list[LayerCache]:
    """Each layer's rolling window of rotated KV heads; a compressed layer's cache also keeps each token's
    compressor projections (kv and gate), a compressed sparse layer's its indexer's as well."""
    d, index = m.head_dim, m.index_head_dim
    widths = {
        SLIDING: 0,
        HCA: 2 * _compressor_out(d, overlap=False),
        CSA: 2 * _compressor_out(d, overlap=True) + 2 * _compressor_out(index, overlap=True),
    }
    return [CompressedWindow(d, m.sliding_window, widths[kind]) for kind in v4_layer_types(m)]


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


def hyper_connection_parameters(m: ModelConfig) -> int:
    """One HyperConnection's parameters: ``fn``, ``base``, ``scale``."""
    n = m.hc_mult
    return (2 + n) * n * (n * m.hidden_size + 1) + 3


def hyper_head_parameters(m: ModelConfig) -> int:
    """The HyperHead's parameters: ``hc_fn``, ``hc_base``, ``hc_scale``."""
    n = m.hc_mult
    return n * (n * m.hidden_size + 1) + 1


def deepseek_v4_num_parameters(m: ModelConfig, active: bool = False) -> int:
    """Parameters of the whole model (``active``: those one token meets: its top-k routed experts). The
    routing bias and the hash table are buffers (not counted, as in transformers)."""
    h, ffn = m.hidden_size, m.moe_ffn_hidden_size
    experts = m.moe_top_k if active else m.num_experts
    per_layer_moe = m.num_experts * h + 3 * h * ffn * (experts + m.moe_shared_experts)
    total = 0
    for kind in v4_layer_types(m):
        total += v4_attention_parameters(m, kind) + 2 * hyper_connection_parameters(m) + 2 * h + per_layer_moe
    return total + hyper_head_parameters(m) + h + (m.vocab_size or 0) * h * (1 if m.tie_word_embeddings else 2)


# -- the model ----------------------------------------------------------------------------------------


def deepseek_v4_defaults(cfg: ModelConfig) -> None:
    """One shared key/value head; no dense MLP (its width set to the experts'); the MoE family's defaults."""
    if cfg.num_key_value_heads is None:
        cfg.num_key_value_heads = 1
    if cfg.ffn_hidden_size is None:
        cfg.ffn_hidden_size = cfg.moe_ffn_hidden_size
    moe_defaults(cfg)


class DeepseekV4Model(MoEModel):
    """One DeepSeek-V4 model (see the module docstring; :class:`DecoderLM` for the arguments of
    ``forward``). Parameters carry transformers' module names (``layers.<i>.self_attn.*``,
    ``layers.<i>.attn_hc.*``, ``hc_head.*``); the MoE layers' are the MoE family's."""

    ARCH = DecoderArch(normalization="rmsnorm", activation="swiglu", position_embedding="none")
    fill_defaults = staticmethod(deepseek_v4_defaults)

    def _build(self, layer_ids: list[int]) -> None:
        super()._build(layer_ids)
        if self.post_process:
            c = self.config
            self.hc_head = HyperHead(
                c.hidden_size, c.hc_mult, eps=c.hc_eps, norm_eps=c.norm_eps, init_std=c.init_method_std,
                dtype=torch.float32,
            )  # fmt: skip

    def build_attention(self, layer_id: int) -> CompressedSparseAttention:
        c, b = self.config, self.block_config
        kind = v4_layer_types(c)[layer_id]
        compressed = {}
        if kind != SLIDING:
            compressed = dict(
                compress_rate=v4_compress_rates(c)[kind],
                index_n_heads=c.index_n_heads,
                index_head_dim=c.index_head_dim,
                index_topk=c.index_topk,
            )
        return CompressedSparseAttention(
            c.hidden_size, c.num_attention_heads, c.head_dim, layer_type=kind, q_lora_rank=c.q_lora_rank,
            qk_rope_head_dim=rope_head_dim(c), o_groups=c.o_groups, o_lora_rank=c.o_lora_rank,
            sliding_window=c.sliding_window, rope_theta=c.rope_theta, compress_rope_theta=c.compress_rope_theta,
            rope_scaling=c.rope_scaling, norm_eps=c.norm_eps, init_std=c.init_method_std,
            init_method=init_normal(b.init_method_std), output_init_method=init_normal(b.output_layer_init_std),
            **compressed,
        )  # fmt: skip

    def build_layer(self, layer_id: int) -> DeepseekV4Block:
        c = self.config
        mlp = MoELayer(v4_moe_config(c, layer_id, self.moe_config()))
        return DeepseekV4Block(
            self.build_attention(layer_id), mlp, c.hidden_size, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps,
            c.init_method_std, recompute=c.activation_checkpointing,
        )  # fmt: skip

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        segment_ids: Optional[torch.Tensor] = None,
        hidden_states: Optional[torch.Tensor] = None,
        last_position_only: bool = False,
    ) -> torch.Tensor:
        if input_ids is None:
            raise ValueError("DeepseekV4Model.forward needs input_ids: its hash-routed layers route by them")
        c = self.config
        if self.pre_process:
            streams = expand_streams(self._embed(input_ids, position_ids), c.hc_mult)
        elif hidden_states is None:
            raise ValueError("a stage without the embedding needs hidden_states from the previous stage")
        else:  # the previous stage's streams, flattened [b, s, hc_mult · h] (stage_hidden_size)
            streams = hidden_states.unflatten(-1, (c.hc_mult, c.hidden_size))
        # each rank's share of the sequence under sequence parallelism, as its MoE layers route it
        token_ids = mappings.scatter_to_sequence_parallel_region(input_ids) if self.sequence_parallel else input_ids
        for layer in self.layers.values():
            streams = layer(streams, token_ids, position_ids, segment_ids)
        if not self.post_process:
            return streams.flatten(-2)
        if last_position_only:
            streams = streams[:, -1:]
        return self.lm_head(self.norm(self.hc_head(streams)), labels)


def check_deepseek_v4_config(cfg: MegacannConfig, source: str) -> None:
    """DeepSeek-V4's keys, what its layers cannot run yet (refused by name), then the MoE family's checks."""
    m, d = cfg.model, cfg.distributed
    check_deepseek_v4_keys(m, source)
    refused = {
        "model.mtp_num_layers": (m.mtp_num_layers, 0, "multi-token prediction is not built for DeepSeek-V4 (as in transformers)"),
        "model.moe_layer_freq": (m.moe_layer_freq, 1, "every DeepSeek-V4 layer is an MoE layer"),
    }  # fmt: skip
    for key, (value, allowed, why) in refused.items():
        if value != allowed:
            raise ConfigError(
                f"{source}: {key} {value!r} is refused for model.type deepseek_v4 ({allowed!r} only): {why}"
            )
    needs = "its compressors pool windows of the whole sequence"
    require_context_parallel_algo(cfg, source, COMPRESSED_CONTEXT_PARALLEL_ALGO, needs)
    for key, count in (("num_attention_heads", m.num_attention_heads), ("o_groups", m.o_groups)):
        if count % d.tensor_parallel_size:
            raise ConfigError(
                f"{source}: model.{key} {count} is not divisible by distributed.tensor_parallel_size "
                f"{d.tensor_parallel_size} (whole heads and output groups per rank)"
            )
    check_moe_config(cfg, source)


def deepseek_v4_flops_per_token(m: ModelConfig, seq_length: int) -> float:
    """6N (N: the weights a token meets but the input embedding) plus the attention's scores and values,
    12 L H d T: an upper bound (each query reads its window and the compressed entries, fewer than T)."""
    n = deepseek_v4_num_parameters(m, active=True) - (m.vocab_size or 0) * m.hidden_size
    return 6.0 * n + 12.0 * m.num_layers * m.num_attention_heads * m.head_dim * seq_length


def v4_attention_parameters_per_rank(m: ModelConfig, tp: int, layer_type: str) -> int:
    """One layer's compressed attention on one TP rank: the whole layer less the head-split parts' other
    ranks' shares (the head-split parts: ``q_b_proj``, the sinks, both parts of the grouped output projection)."""
    width = m.num_attention_heads * m.head_dim
    split = (
        m.q_lora_rank * width
        + m.num_attention_heads
        + width * m.o_lora_rank
        + m.o_groups * m.o_lora_rank * m.hidden_size
    )
    return v4_attention_parameters(m, layer_type) - split + split // tp


def v4_layer_parameters_per_rank(m: ModelConfig, tp: int, layer_id: int, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of layer ``layer_id`` on one TP rank of one expert-parallel rank."""
    h, f = m.hidden_size, m.moe_ffn_hidden_size
    attention = v4_attention_parameters_per_rank(m, tp, v4_layer_types(m)[layer_id])
    dense = attention + 2 * hyper_connection_parameters(m) + 2 * h
    dense += m.num_experts * h + 3 * h * f * m.moe_shared_experts // tp
    return dense, m.num_experts // ep * 3 * h * f // tp


def v4_fp32_parameters_per_rank(m: ModelConfig, tp: int, layer_ids: list[int], last: bool) -> int:
    """Parameters of these layers (and the hyper-connection head when ``last``) kept in fp32 whatever the
    model's precision, on one TP rank: hyper-connections, sinks (split), position biases (whole)."""
    rates, kinds = v4_compress_rates(m), v4_layer_types(m)
    biases = {CSA: rates[CSA] * 2 * (m.head_dim + m.index_head_dim), HCA: rates[HCA] * m.head_dim}
    per_layer = 2 * hyper_connection_parameters(m) + m.num_attention_heads // tp
    fp32 = sum(per_layer + biases.get(kinds[i], 0) for i in layer_ids)
    return fp32 + (hyper_head_parameters(m) if last else 0)


def v4_head_parameters(m: ModelConfig) -> int:
    """The last stage's hyper-connection head and final norm (the output layer is counted apart)."""
    return hyper_head_parameters(m) + m.hidden_size


DEEPSEEK_V4 = dataclasses.replace(
    moe_model_spec(
        "deepseek_v4",
        DeepseekV4Model,
        config_class=DeepseekV4ModelConfig,
        check_config=check_deepseek_v4_config,
        hf=DEEPSEEK_V4_HF,
        num_parameters=deepseek_v4_num_parameters,
        flops_per_token=deepseek_v4_flops_per_token,
    ),
    decode=decoder_decode_step,
    decode_cache=deepseek_v4_decode_cache,
    architecture=None,  # not a standard decoder: megacann-plan reads its own formulas
    rank_parameters=RankParameterFormulas(
        v4_layer_parameters_per_rank, v4_head_parameters, v4_fp32_parameters_per_rank, V4_ACTIVATIONS
    ),
    moe_structure=None,
    sharding_units=(DeepseekV4Block,),
)

__all__ = ["DEEPSEEK_V4", "DeepseekV4Block", "DeepseekV4Model", "deepseek_v4_num_parameters"]
