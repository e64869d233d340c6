"""Parameter counts and training FLOPs of the models, from their config alone (no weights needed)."""

from __future__ import annotations

from megacann.config import ModelConfig
from megacann.layers.embedding import pad_vocab_size

padded_vocab_size = pad_vocab_size  # the vocabulary as VocabParallelEmbedding pads it


def layer_parameters(cfg: ModelConfig) -> int:
    """Parameters of one transformer layer."""
    h, ffn = cfg.hidden_size, cfg.ffn_size
    head_dim = h // cfg.num_attention_heads
    kv = cfg.kv_heads * head_dim
    bias = cfg.use_bias
    attn = h * h + 2 * h * kv + h * h + (h + 2 * kv + h if bias else 0)
    if cfg.type == "gpt":
        mlp = 2 * h * ffn + (ffn + h if bias else 0)
        norms = 4 * h  # two LayerNorms with bias
    else:
        mlp = 3 * h * ffn + (2 * ffn + h if bias else 0)
        norms = 2 * h
    return attn + mlp + norms


def num_parameters(cfg: ModelConfig, vocab_size: int | None = None) -> int:
    """Total parameters (embedding, layers, final norm, untied head, GPT positions)."""
    vocab = vocab_size or cfg.vocab_size or 0
    h = cfg.hidden_size
    total = vocab * h + cfg.num_layers * layer_parameters(cfg)
    total += 2 * h if cfg.type == "gpt" else h  # final norm
    if cfg.type == "gpt":
        total += cfg.max_position_embeddings * h
    if not cfg.tie_word_embeddings:
        total += vocab * h
    return total


def matmul_parameters(cfg: ModelConfig, vocab_size: int | None = None) -> int:
    """Parameters that take part in matrix multiplies: layers' weights and the output head (PaLM's N)."""
    vocab = vocab_size or cfg.vocab_size or 0
    h, ffn = cfg.hidden_size, cfg.ffn_size
    kv = cfg.kv_heads * (h // cfg.num_attention_heads)
    mlp = (2 if cfg.type == "gpt" else 3) * h * ffn
    per_layer = 2 * h * h + 2 * h * kv + mlp
    return cfg.num_layers * per_layer + vocab * h


def flops_per_token(cfg: ModelConfig, seq_length: int, vocab_size: int | None = None) -> float:
    """Training FLOPs per token by the PaLM formula: 6N + 12 L H Q T (recompute not counted)."""
    n = matmul_parameters(cfg, vocab_size)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 6.0 * n + 12.0 * cfg.num_layers * cfg.num_attention_heads * head_dim * seq_length
