#!/usr/bin/env python3
"""A model that megacann does not ship, written only from megacann.layers and trained by megacann's trainer.

PaLM / GPT-J style parallel blocks: attention and MLP read the same normalised input and both add to the
residual, ``h = h + attn(norm(h)) + mlp(norm(h))``; RoPE, SwiGLU, RMSNorm, a vocabulary-parallel head.
Registering its spec (last lines) is all it takes for every layout of the recipe to work: tensor and
sequence parallel, context parallel (the schedules hand each cp rank its tokens and their global
``position_ids``), pipeline stages (also interleaved), data parallel with ZeRO (stage 3 gathers one
``ParallelBlock`` at a time: the spec's ``sharding_units``), checkpoints and resume; and generation with a
key/value cache (``decode``: megacann.generation), on pipeline stages too.
The layers take sequence parallelism, dtype, device, the context-parallel algorithm, initialisation and
recompute from the layer context ``build_chunk`` makes from the recipe: the model code names none of them.

    python examples/custom_model.py --config examples/configs/custom/tiny.yaml [section.key=value ...]
    torchrun --nproc_per_node 4 examples/custom_model.py --config examples/configs/custom/tiny.yaml \\
        distributed.tensor_parallel_size=2 distributed.sequence_parallel=true distributed.pipeline_parallel_size=2
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

from megacann.config import MegacannConfig, ModelConfig
from megacann.layers import (
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    SwiGLUMLP,
    VocabParallelEmbedding,
    checkpoint,
    current_layer_context,
    dropout,
    initialize_weights,
    tie_embedding_across_stages,
)
from megacann.models import ChunkOutput, ChunkPlacement, ModelSpec, layer_context_from_config, register_model


class ParallelBlock(torch.nn.Module):
    """One shared norm, then attention and MLP side by side; both outputs join the residual."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        ctx = current_layer_context()  # what the layers below take too: see build_chunk
        self.dropout, self.sequence_parallel = m.hidden_dropout, ctx.sequence_parallel
        self.full_recompute = ctx.recompute == "full"  # "selective" reaches SelfAttention by itself
        self.norm = RMSNorm(m.hidden_size, m.norm_eps)
        self.self_attn = SelfAttention(
            m.hidden_size, m.num_attention_heads, m.num_key_value_heads, qkv_bias=m.add_bias_linear,
            output_bias=m.add_bias_linear, attention_dropout=m.attention_dropout, rotary_interleaved=m.rotary_interleaved,
        )  # fmt: skip
        self.mlp = SwiGLUMLP(m.hidden_size, m.ffn_hidden_size, bias=m.add_bias_linear)

    def _forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segment_ids) -> torch.Tensor:
        x = self.norm(h)
        branches = self.self_attn(x, (cos, sin), segment_ids) + self.mlp(x)
        return h + dropout(branches, self.dropout, self.training, self.sequence_parallel)

    def forward(self, h: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], segment_ids) -> torch.Tensor:
        if self.full_recompute and self.training:
            return checkpoint(self._forward, h, *rotary, segment_ids)
        return self._forward(h, *rotary, segment_ids)


class ParallelLM(torch.nn.Module):
    """The part of the model one pipeline chunk holds: embedding (first chunk), its blocks, norm and head
    (last chunk). Blocks are named by their global index, so every layout starts from the same weights."""

    def __init__(self, m: ModelConfig, placement: ChunkPlacement):
        super().__init__()
        self.pre_process, self.post_process = placement.pre_process, placement.post_process
        vocab = dict(make_vocab_size_divisible_by=m.make_vocab_size_divisible_by)
        if self.pre_process:
            self.embed_tokens = VocabParallelEmbedding(m.vocab_size, m.hidden_size, **vocab)
            if m.tie_word_embeddings and not self.post_process:
                tie_embedding_across_stages(self.embed_tokens)
        self.layers = torch.nn.ModuleDict({str(i): ParallelBlock(m) for i in placement.layer_ids})
        self.rotary = RotaryEmbedding(
            m.hidden_size // m.num_attention_heads, m.rope_theta, m.rope_scaling, m.rotary_interleaved
        )
        if self.post_process:
            self.norm = RMSNorm(m.hidden_size, m.norm_eps)
            tie_to = (
                (self.embed_tokens if self.pre_process else "embed_tokens.weight") if m.tie_word_embeddings else None
            )
            self.lm_head = LMHead(m.hidden_size, m.vocab_size, tie_to=tie_to, **vocab)

    def hidden(self, batch: dict[str, torch.Tensor], hidden_states: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The hidden states out of this chunk's blocks (the first chunk embeds ``batch["tokens"]``)."""
        tokens = batch["tokens"]
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        h = self.embed_tokens(tokens) if self.pre_process else hidden_states
        rotary = self.rotary(positions, dtype=h.dtype)
        for block in self.layers.values():
            h = block(h, rotary, batch.get("segment_ids"))
        return h

    def forward(self, batch: dict[str, torch.Tensor], hidden_states: Optional[torch.Tensor] = None) -> ChunkOutput:
        h = self.hidden(batch, hidden_states)
        if not self.post_process:
            return ChunkOutput(hidden_states=h)
        return ChunkOutput(token_loss=self.lm_head(self.norm(h), batch["labels"]))


# -- the model contract: how megacann builds, runs and sizes this family -----------------------------------


def build_chunk(cfg: MegacannConfig, placement: ChunkPlacement, device=None) -> ParallelLM:
    # sequence parallel (when tp > 1), dtype, device, context-parallel algorithm, init std and scaled init of
    # o_proj / down_proj, recompute: from the recipe, for every layer built inside the with
    with layer_context_from_config(cfg, device):
        model = ParallelLM(cfg.model, placement)
    initialize_weights(model, cfg.seed)  # each weight drawn from the seed and its name: layout-independent
    return model


def decode(
    chunk: ParallelLM, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden_states: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Generation (megacann.generation): the next token's logits ``[b, 1, vocab]`` out of the last chunk, the
    hidden states out of the others; the blocks' SelfAttention layers read the key/value caches the generator
    sets on them, so this is the training forward without the loss."""
    h = chunk.hidden({"tokens": input_ids, "position_ids": position_ids}, hidden_states)
    return chunk.lm_head(chunk.norm(h[:, -1:])) if chunk.post_process else h


def fill_defaults(m: ModelConfig) -> None:
    m.ffn_hidden_size = m.ffn_hidden_size or 4 * m.hidden_size
    m.add_bias_linear = bool(m.add_bias_linear)


def flops_per_token(m: ModelConfig, seq_length: int) -> float:
    """PaLM's 6N + 12 L H Q T, N counting the matrices (attention, MLP, head)."""
    h, head_dim = m.hidden_size, m.hidden_size // m.num_attention_heads
    kv = m.kv_heads * head_dim
    n = m.num_layers * (2 * h * h + 2 * h * kv + 3 * h * m.ffn_hidden_size) + m.vocab_size * h
    return 6.0 * n + 12.0 * m.num_layers * h * seq_length


PARALLEL_LM = register_model(
    ModelSpec(
        name="parallel_lm",
        build_chunk=build_chunk,
        forward_step=lambda chunk, batch, hidden_states: chunk(batch, hidden_states),
        flops_per_token=flops_per_token,
        fill_defaults=fill_defaults,
        sharding_units=(ParallelBlock,),  # ZeRO-3 gathers one block's weights at a time
        decode=decode,  # megacann.generation generates with it, at every layout but context parallel
    )
)

if __name__ == "__main__":
    from megacann.cli import train_main

    sys.exit(train_main(sys.argv[1:], expected_model_type="parallel_lm"))
