"""A decoder-only language model (one pipeline stage of it), built only from ``megacann.layers``.

    tokens -> embed_tokens (+ embed_positions) -> layers[i] ... -> norm -> lm_head -> per-token loss

:class:`DecoderArch` names the architectural choices (normalisation, MLP activation, position encoding);
LLaMA (``models/llama.py``) and GPT (``models/gpt.py``) are this model with their choices. A pipeline stage
holds the embedding only if it is the first stage (``pre_process``), the head only if it is the last
(``post_process``), and the layers whose *global* indices it is given; layers are stored under their
global index (``layers.17.…``), so parameter names, initialisation and checkpoints do not depend on the
parallel layout. Tied input/output embeddings split over stages are handled by
:class:`megacann.layers.LMHead`. Sequence parallelism, parameter dtype and device and the context-parallel
algorithm come from the :class:`~megacann.layers.LayerContext` the model is built under (the spec's
``build_chunk`` makes it from the recipe); the shape, initialisation and recompute from ``cfg``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Callable, ClassVar, Optional

import torch
import torch.nn.functional as F

from megacann import parallel_state as ps
from megacann.config import MegacannConfig, ModelConfig
from megacann.layers import (
    LayerContext,
    LayerNorm,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    TransformerBlock,
    TransformerBlockConfig,
    VocabParallelEmbedding,
    current_layer_context,
    dropout,
    init_normal,
    initialize_weights,
    make_parameter,
    tie_embedding_across_stages,
)
from megacann.layers.context import block_layer_context
from megacann.layers.context_parallel import context_parallel_position_ids
from megacann.layers.embedding import vocab_parallel_embedding
from megacann.layers.multi_token_prediction import MTPLayer, MultiTokenPrediction, embedding_copy_for_last_stage
from megacann.models import sizing
from megacann.models.contract import ChunkOutput
from megacann.models.mtp import mtp_depths, mtp_matmul_parameters, mtp_parameters
from megacann.models.spec import ChunkPlacement, HFAdapter, ModelSpec, layer_context_from_config

EMBEDDING_WEIGHT = "embed_tokens.weight"  # the name a last stage's tied copy of the embedding is drawn from


@dataclass(frozen=True)
class DecoderArch:
    """The choices that tell decoder families apart (LLaMA: RMSNorm, SwiGLU, RoPE; GPT: LayerNorm with
    bias, GELU, learned positions; Qwen2: LLaMA with q, k, v biases; Qwen3: LLaMA with q/k norms)."""

    normalization: str = "rmsnorm"  # rmsnorm | layernorm
    activation: str = "swiglu"  # swiglu | gelu | gelu_tanh
    position_embedding: str = "rope"  # rope | learned
    qkv_bias: Optional[bool] = None  # q, k, v biases; None: as the other projections (model.add_bias_linear)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
    latent_attention: bool = False  # multi-head latent attention (DeepSeek-V3): its keys are the family's
    sparse_indexer: bool = False  # a lightning indexer picks each query's keys (DeepSeek-V3.2; the family's keys)
    attention_sinks: bool = False  # one learned sink logit per head joins the softmax (gpt-oss)
    attention_output_gate: bool = False  # q_proj also gives a gate; the heads' output times its sigmoid (Qwen3.5)
    partial_rotary: bool = False  # RoPE on the first ``partial_rotary_factor`` of each head (the family's key)
    # which layers are Gated DeltaNet linear attention (reading the family's ``linear_*`` keys); None: none
    linear_attention_layers: Optional[Callable[[ModelConfig], list[bool]]] = None

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one MLP (a gated activation has a gate projection besides up and down)."""
        return 3 if self.activation == "swiglu" else 2

    @property
    def norm_parameters_per_width(self) -> int:
        """Parameters of one norm per hidden unit (LayerNorm also has a bias)."""
        return 2 if self.normalization == "layernorm" else 1


def block_config(cfg: ModelConfig, arch: DecoderArch) -> TransformerBlockConfig:
    """The TransformerBlock settings of a model config and architecture; sequence parallelism, dtype and
    the context-parallel algorithm are left to the layer context."""
    return TransformerBlockConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_heads,
        ffn_hidden_size=cfg.ffn_size,
        normalization=arch.normalization,
        norm_eps=cfg.norm_eps,
        activation=arch.activation,
        add_bias_linear=cfg.use_bias,
        add_qkv_bias=arch.qkv_bias,
        qk_norm=arch.qk_norm,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        head_dim=sizing.attention_head_dim(cfg),
        init_method_std=cfg.init_method_std,
        output_layer_init_std=cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers),
        position_embedding="rope" if arch.position_embedding == "rope" else "none",
        rotary_theta=cfg.rope_theta,
        rotary_scaling=cfg.rope_scaling,
        rotary_interleaved=cfg.rotary_interleaved,
        recompute=cfg.activation_checkpointing,
    )


class DecoderLM(torch.nn.Module):
    """One pipeline stage of a decoder-only LM (the whole model when there is one stage).

    ``forward(input_ids, position_ids=None, labels=None, segment_ids=None, hidden_states=None)`` returns
    hidden states ``[b, s_local, h]`` on a stage without the head; on the last stage the per-token loss
    ``[b, s]`` (fp32) when ``labels`` are given, else logits ``[b, s, vocab_size]`` (``[b, 1, vocab_size]``
    of the last position with ``last_position_only=True``, what generation needs). ``arch`` defaults to
    the class's ``ARCH``. With multi-token prediction (``cfg.mtp_num_layers`` > 0; docs/models.md) the
    last stage given ``labels`` returns a :class:`~megacann.layers.ChunkOutput`: the per-token loss and the
    scaled MTP loss as the auxiliary loss ``mtp_loss``. Under context parallelism every input is this cp
    rank's share of the sequence (``s = seq_length / cp``) and ``position_ids`` name the tokens' global
    positions (the schedules give both; see :func:`megacann.layers.context_parallel.context_parallel_batch`).
    ``context``: the layer context to build under (default: the current one).
    """

    ARCH: ClassVar[DecoderArch] = DecoderArch()

    @staticmethod
    def fill_defaults(cfg: ModelConfig) -> None:
        """Fill the family's defaults (MLP width, biases) into ``cfg`` where it leaves them unset."""

    def __init__(
        self,
        cfg: ModelConfig,
        arch: Optional[DecoderArch] = None,
        *,
        layer_ids: Optional[Iterable[int]] = None,
        pre_process: bool = True,
        post_process: bool = True,
        context: Optional[LayerContext] = None,
    ):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("model.vocab_size is not set (it comes from the tokenizer when training)")
        arch = arch or self.ARCH
        cfg = replace(cfg)
        self.fill_defaults(cfg)
        self.config, self.arch = cfg, arch
        self.vocab_size = cfg.vocab_size
        context = context or current_layer_context()
        self.sequence_parallel = context.sequence_parallel
        self.pre_process, self.post_process = pre_process, post_process
        self.block_config = self.make_block_config(cfg, arch)
        layer_ids = list(range(cfg.num_layers)) if layer_ids is None else list(layer_ids)
        with context:
            self._build(layer_ids)

    def _build(self, layer_ids: list[int]) -> None:
        cfg, arch, h, std = self.config, self.arch, self.config.hidden_size, self.config.init_method_std
        pre_process, post_process = self.pre_process, self.post_process
        if pre_process:
            self.embed_tokens = VocabParallelEmbedding(
                cfg.vocab_size, h, init_normal(std), cfg.make_vocab_size_divisible_by
            )
            # the last stage holds a copy: the tied head's, or multi-token prediction's
            if (cfg.tie_word_embeddings or mtp_depths(cfg)) and not post_process:
                tie_embedding_across_stages(self.embed_tokens)
            if arch.position_embedding == "learned":
                self.embed_positions = make_parameter(
                    (cfg.max_position_embeddings, h),
                    init_normal(std),
                    tp_rank=ps.get_tensor_model_parallel_rank(),
                    tp_size=ps.get_tensor_model_parallel_world_size(),
                    name="embed_positions",
                    tp_partial_grad=self.sequence_parallel,  # each rank adds its own sequence shard
                )
        self.layers = torch.nn.ModuleDict({str(i): self._build_block(i) for i in layer_ids})
        self.rotary = None
        if arch.position_embedding == "rope" and (layer_ids or (post_process and mtp_depths(cfg))):
            self.rotary = RotaryEmbedding(self.rotary_width(), cfg.rope_theta, cfg.rope_scaling, cfg.rotary_interleaved)
        if post_process:
            if arch.normalization == "layernorm":
                self.norm = LayerNorm(h, cfg.norm_eps, bias=True)
            else:
                self.norm = RMSNorm(h, cfg.norm_eps)
            tie_to = None
            if cfg.tie_word_embeddings:
                tie_to = self.embed_tokens if pre_process else EMBEDDING_WEIGHT
            self.lm_head = LMHead(
                h,
                cfg.vocab_size,
                init_method=init_normal(std),
                make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
                tie_to=tie_to,
            )
        self.mtp = self._build_mtp() if post_process and mtp_depths(cfg) else None

    def _build_mtp(self) -> MultiTokenPrediction:
        """The multi-token prediction depths (last stage), and on a last stage without the input embedding
        or a tied head holding its copy, a copy of the embedding tied to the first stage's."""
        cfg, std = self.config, self.config.init_method_std
        if not self.pre_process and not cfg.tie_word_embeddings:
            self.mtp_embed_tokens = embedding_copy_for_last_stage(
                cfg.vocab_size, cfg.hidden_size, EMBEDDING_WEIGHT, cfg.make_vocab_size_divisible_by
            )
        layers = [
            MTPLayer(cfg.hidden_size, self.build_mtp_layer(k), norm_eps=cfg.norm_eps, init_method=init_normal(std))
            for k in range(mtp_depths(cfg))
        ]
        return MultiTokenPrediction(layers, cfg.mtp_loss_scaling_factor)

    def build_mtp_layer(self, depth: int) -> torch.nn.Module:
        """The transformer layer of MTP depth ``depth + 1``: one of the kind of the model's last layer (a
        family whose MTP layers differ overrides this)."""
        return self.build_layer(self.config.num_layers - 1)

    def rotary_width(self) -> int:
        """How many dims of each head RoPE turns: all of them here (a family with partial rotary, fewer)."""
        return self.block_config.attention_head_dim

    @staticmethod
    def make_block_config(cfg: ModelConfig, arch: DecoderArch) -> TransformerBlockConfig:
        """The settings of this family's blocks (:func:`block_config`); a family whose attention has more
        (Mistral's sliding window) overrides this."""
        return block_config(cfg, arch)

    def _build_block(self, layer_id: int) -> torch.nn.Module:
        with block_layer_context(layer_id):  # precision.fp8 may leave the first / last blocks out
            return self.build_layer(layer_id)

    def build_layer(self, layer_id: int) -> torch.nn.Module:
        """Layer ``layer_id`` (global index): a dense block here; a family with another feed-forward
        block (MoE) overrides this. It runs under the model's layer context, with ``self.config`` and
        ``self.block_config`` set."""
        return TransformerBlock(self.block_config)

    # -- forward ------------------------------------------------------------------------------------
    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.arch.position_embedding == "learned":
            if self.sequence_parallel:  # this rank's shard of the sequence
                s_local = hidden.shape[1]
                start = ps.get_tensor_model_parallel_rank() * s_local
                position_ids = position_ids[:, start : start + s_local]
            hidden = hidden + F.embedding(position_ids, self.embed_positions)
        return dropout(hidden, self.config.hidden_dropout, self.training, self.sequence_parallel)

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        segment_ids: Optional[torch.Tensor] = None,
        hidden_states: Optional[torch.Tensor] = None,
        last_position_only: bool = False,
    ) -> torch.Tensor:
        reference = input_ids if input_ids is not None else labels
        if position_ids is None:
            if reference is None:
                raise ValueError("forward needs input_ids, labels or position_ids to know the sequence")
            b, s = reference.shape  # this cp rank's share: its tokens' global positions
            cp = ps.get_context_parallel_world_size()
            position_ids = context_parallel_position_ids(s * cp, device=reference.device).unsqueeze(0).expand(b, s)
        if self.pre_process:
            hidden = self._embed(input_ids, position_ids)
        elif hidden_states is None:
            raise ValueError("a stage without the embedding needs hidden_states from the previous stage")
        else:
            hidden = hidden_states
        rotary = self.rotary(position_ids, dtype=hidden.dtype) if self.rotary is not None else None
        for layer in self.layers.values():
            hidden = layer(hidden, rotary, segment_ids)
        if not self.post_process:
            return hidden
        if last_position_only:  # generation: only the next token's logits (not [b, s, vocab] of a prompt)
            hidden = hidden[:, -1:]
        hidden = self.norm(hidden)
        loss = self.lm_head(hidden, labels)
        if self.mtp is None or labels is None:
            return loss
        mtp_loss, _ = self.mtp(hidden, input_ids, labels, self._mtp_embed, self.lm_head, rotary, segment_ids)
        return ChunkOutput(token_loss=loss, aux_losses={"mtp_loss": mtp_loss})

    def _mtp_embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embedding for multi-token prediction on this (last) stage: the model's own, the
        stage's tied copy, or the tied head's weight (which then is that copy)."""
        if self.pre_process:
            return self.embed_tokens(input_ids)
        if hasattr(self, "mtp_embed_tokens"):
            return self.mtp_embed_tokens(input_ids)
        return vocab_parallel_embedding(input_ids, self.lm_head.output_weight, self.sequence_parallel)


def decoder_flops_per_token(cfg: ModelConfig, seq_length: int, arch: DecoderArch) -> float:
    """PaLM FLOPs per token of a decoder, its multi-token prediction depths included."""
    per_layer = sizing.attention_matmul_parameters(cfg) + arch.mlp_matrices * cfg.hidden_size * cfg.ffn_size
    n = sizing.matmul_parameters(cfg, arch) + mtp_matmul_parameters(cfg, per_layer)
    return sizing.palm_flops_per_token(n, cfg, seq_length, extra_layers=mtp_depths(cfg))


def decoder_decode_step(
    chunk: DecoderLM,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    hidden_states: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A decoder's decode path (``ModelSpec.decode``): the logits ``[b, 1, vocab]`` of the token after the
    last of ``input_ids``; the attention layers' key/value caches hold the earlier tokens
    (:class:`~megacann.layers.SelfAttention` ``kv_cache``). On a pipeline stage without the embedding,
    ``hidden_states`` come from the previous stage; a stage without the head returns its hidden states."""
    return chunk(input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states, last_position_only=True)


def decoder_model_spec(
    name: str,
    model_class: type[DecoderLM],
    *,
    check_config: Optional[Callable[[MegacannConfig, str], None]] = None,
    hf: Optional[HFAdapter] = None,
) -> ModelSpec:
    """The :class:`ModelSpec` of a :class:`DecoderLM` family (``model_class`` fixes its architecture)."""
    arch = model_class.ARCH

    def build_chunk(cfg: MegacannConfig, placement: ChunkPlacement, device=None) -> DecoderLM:
        model = model_class(
            cfg.model,
            layer_ids=placement.layer_ids,
            pre_process=placement.pre_process,
            post_process=placement.post_process,
            context=layer_context_from_config(cfg, device),
        )
        initialize_weights(model, cfg.seed)
        return model

    extra = {"check_config": check_config} if check_config else {}
    return ModelSpec(
        name=name,
        build_chunk=build_chunk,
        flops_per_token=lambda m, seq: decoder_flops_per_token(m, seq, arch),
        num_parameters=lambda m: sizing.num_parameters(m, arch) + mtp_parameters(m, sizing.layer_parameters(m, arch)),
        fill_defaults=model_class.fill_defaults,
        hf=hf,
        architecture=arch,
        sharding_units=(TransformerBlock,),  # ZeRO-3 gathers one block at a time
        decode=decoder_decode_step,
        **extra,
    )
