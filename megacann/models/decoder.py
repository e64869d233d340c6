"""A decoder-only language model (one pipeline stage of it), built only from ``megacann.layers``.

    tokens -> embed_tokens (+ embed_positions for GPT) -> layers[i] ... -> norm -> lm_head -> loss

``LlamaModel`` and ``GPTModel`` are this model with LLaMA's and GPT's choices (RMSNorm + RoPE + SwiGLU,
or LayerNorm + learned positions + GELU). A pipeline stage holds the embedding only if it is the first
stage (``pre_process``), the head only if it is the last (``post_process``), and the layers whose
*global* indices it is given; layers are stored under their global index (``layers.17.…``), so
parameter names, initialisation and checkpoints do not depend on the parallel layout.

Tied input/output embeddings split over stages: the last stage holds a copy as ``lm_head.weight``,
initialised from the name ``embed_tokens.weight``; both are marked with ``mark_tied_across_stages`` so
the optimizer sums their gradients over the embedding group and counts the copy once in norms.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import replace
from typing import Optional, Union

import torch
import torch.nn.functional as F

from megacann import parallel_state as ps
from megacann.config import ModelConfig
from megacann.layers import (
    ColumnParallelLinear,
    LayerNorm,
    RMSNorm,
    RotaryEmbedding,
    TransformerBlock,
    TransformerBlockConfig,
    VocabParallelEmbedding,
    dropout,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    get_sharding,
    init_normal,
    make_parameter,
    pad_vocab_size,
    set_sharding,
    vocab_parallel_cross_entropy,
)
from megacann.layers import copy_to_tensor_model_parallel_region as copy_to_tp
from megacann.layers.sharding import INIT_ATTR, init_sharded_, mark_tied_across_stages

# A parameter that must start equal to another one (the last stage's copy of a tied embedding) names
# that parameter in this attribute; initialisation seeds from the named one.
INIT_NAME_ATTR = "megacann_init_name"

IGNORE_INDEX = -100


def block_config(
    cfg: ModelConfig, sequence_parallel: bool, params_dtype: Optional[torch.dtype]
) -> TransformerBlockConfig:
    """The TransformerBlock settings of a model config (LLaMA or GPT flavour)."""
    is_gpt = cfg.type == "gpt"
    return TransformerBlockConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_heads,
        ffn_hidden_size=cfg.ffn_size,
        normalization="layernorm" if is_gpt else "rmsnorm",
        norm_eps=cfg.norm_eps,
        activation="gelu" if is_gpt else "swiglu",
        add_bias_linear=cfg.use_bias,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        sequence_parallel=sequence_parallel,
        init_method_std=cfg.init_method_std,
        output_layer_init_std=cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers),
        position_embedding="none" if is_gpt else "rope",
        rotary_theta=cfg.rope_theta,
        rotary_scaling=cfg.rope_scaling,
        rotary_interleaved=cfg.rotary_interleaved,
        recompute=cfg.activation_checkpointing,
        params_dtype=params_dtype,
    )


class DecoderLM(torch.nn.Module):
    """One pipeline stage of a decoder-only LM (the whole model when there is one stage).

    ``forward(input_ids, position_ids=None, labels=None, segment_ids=None, hidden_states=None)`` returns
    hidden states ``[b, s_local, h]`` on a stage without the head; on the last stage the per-token loss
    ``[b, s]`` (fp32) when ``labels`` are given, else logits ``[b, s, vocab_size]``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        sequence_parallel: bool = False,
        layer_ids: Optional[Iterable[int]] = None,
        pre_process: bool = True,
        post_process: bool = True,
        params_dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("model.vocab_size is not set (it comes from the tokenizer when training)")
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.sequence_parallel = sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1
        self.pre_process, self.post_process = pre_process, post_process
        self.block_config = block_config(cfg, self.sequence_parallel, params_dtype)
        layer_ids = list(range(cfg.num_layers)) if layer_ids is None else list(layer_ids)
        h, std = cfg.hidden_size, cfg.init_method_std
        common = dict(dtype=params_dtype, device=device)
        tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()

        if pre_process:
            self.embed_tokens = VocabParallelEmbedding(
                cfg.vocab_size,
                h,
                init_normal(std),
                cfg.make_vocab_size_divisible_by,
                sequence_parallel=self.sequence_parallel,
                **common,
            )
            if cfg.tie_word_embeddings and not post_process:  # the last stage holds a copy (lm_head)
                mark_tied_across_stages(self.embed_tokens.weight, duplicate=False)
            if cfg.type == "gpt":
                self.embed_positions = make_parameter(
                    (cfg.max_position_embeddings, h),
                    init_normal(std),
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    name="embed_positions",
                    tp_partial_grad=self.sequence_parallel,  # each rank adds its own sequence shard
                    **common,
                )
        self.layers = torch.nn.ModuleDict(
            {str(i): TransformerBlock(self.block_config, device=device) for i in layer_ids}
        )
        self.rotary = None
        if cfg.type != "gpt" and layer_ids:
            self.rotary = RotaryEmbedding(
                h // cfg.num_attention_heads, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_interleaved
            )
        if post_process:
            norm_cls = LayerNorm if cfg.type == "gpt" else RMSNorm
            norm_kwargs = {"bias": True} if cfg.type == "gpt" else {}
            self.norm = norm_cls(h, cfg.norm_eps, sequence_parallel=self.sequence_parallel, **norm_kwargs, **common)
            self.lm_head = None
            if not cfg.tie_word_embeddings or not pre_process:
                padded = pad_vocab_size(cfg.vocab_size, tp_size, cfg.make_vocab_size_divisible_by)
                self.lm_head = ColumnParallelLinear(
                    h,
                    padded,
                    bias=False,
                    sequence_parallel=self.sequence_parallel,
                    init_method=init_normal(std),
                    **common,
                )
                weight = self.lm_head.weight
                set_sharding(weight, replace(get_sharding(weight), logical_size=cfg.vocab_size))
                with torch.no_grad():
                    weight[max(0, cfg.vocab_size - tp_rank * weight.shape[0]) :].zero_()
                if cfg.tie_word_embeddings:  # last stage's copy of the first stage's embedding
                    setattr(weight, INIT_NAME_ATTR, "embed_tokens.weight")
                    mark_tied_across_stages(weight, duplicate=True)

    # -- forward ------------------------------------------------------------------------------------
    def output_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.config.type == "gpt":
            if self.sequence_parallel:  # this rank's shard of the sequence
                s_local = hidden.shape[1]
                start = ps.get_tensor_model_parallel_rank() * s_local
                position_ids = position_ids[:, start : start + s_local]
            hidden = hidden + F.embedding(position_ids, self.embed_positions)
        return dropout(hidden, self.config.hidden_dropout, self.training, self.sequence_parallel)

    def _logits_shard(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden)
        else:
            hidden = copy_to_tp(hidden)
        return F.linear(hidden, self.output_weight())

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        segment_ids: Optional[torch.Tensor] = None,
        hidden_states: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        reference = input_ids if input_ids is not None else labels
        if position_ids is None:
            if reference is None:
                raise ValueError("forward needs input_ids, labels or position_ids to know the sequence")
            b, s = reference.shape
            position_ids = torch.arange(s, device=reference.device).unsqueeze(0).expand(b, s)
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
        logits = self._logits_shard(self.norm(hidden))
        if labels is None:
            logits = gather_from_tensor_model_parallel_region(logits)
            return logits[..., : self.vocab_size]
        return vocab_parallel_cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, vocab_size=self.vocab_size)


def parameter_seed(seed: int, name: str) -> int:
    """A seed per parameter name, so weights do not depend on which rank builds which layer."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def initialize_weights(model: torch.nn.Module, seed: int) -> None:
    """Draw every parameter's full tensor from a seed derived from its name, then keep this rank's slice.

    Every TP / PP / virtual-stage layout therefore starts from exactly the weights of one process.
    """
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for name, param in model.named_parameters():
        init = getattr(param, INIT_ATTR, None)
        if init is None:
            raise ValueError(f"parameter {name} has no init method (was it made by megacann.layers?)")
        key = getattr(param, INIT_NAME_ATTR, name)
        init_sharded_(param, init, tp_rank, tp_size, parameter_seed(seed, key))
