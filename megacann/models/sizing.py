"""Parameter counts and training FLOPs of decoder models, from their config alone (no weights needed)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megacann.config import ModelConfig
from megacann.layers.embedding import pad_vocab_size

if TYPE_CHECKING:
    from megacann.models.decoder import DecoderArch

padded_vocab_size = pad_vocab_size  # the vocabulary as VocabParallelEmbedding pads it


def _head_dim(cfg: ModelConfig, head_dim: Optional[int]) -> int:
    return head_dim or cfg.hidden_size // cfg.num_attention_heads


def attention_parameters(cfg: ModelConfig, arch: Optional[DecoderArch] = None, head_dim: Optional[int] = None) -> int:
    """q, k, v and output projections of one layer, with the biases the model has (``arch.qkv_bias``: on
    q, k, v apart from the rest) and ``arch.qk_norm``'s per-head norms. ``head_dim`` None: hidden / heads."""
    d = _head_dim(cfg, head_dim)
    q, kv = cfg.num_attention_heads * d, cfg.kv_heads * d
    qkv_bias = cfg.use_bias if arch is None or arch.qkv_bias is None else arch.qkv_bias
    total = attention_matmul_parameters(cfg, head_dim) + (q + 2 * kv if qkv_bias else 0)
    total += cfg.hidden_size if cfg.use_bias else 0  # o_proj's bias
    return total + (2 * d if arch is not None and arch.qk_norm else 0)


def layer_parameters(cfg: ModelConfig, arch: DecoderArch, head_dim: Optional[int] = None) -> int:
    """Parameters of one transformer layer: attention, MLP and two norms."""
    h, ffn = cfg.hidden_size, cfg.ffn_size
    mlp = arch.mlp_matrices * h * ffn + ((arch.mlp_matrices - 1) * ffn + h if cfg.use_bias else 0)
    return attention_parameters(cfg, arch, head_dim) + mlp + 2 * arch.norm_parameters_per_width * h


def num_parameters(cfg: ModelConfig, arch: DecoderArch, head_dim: Optional[int] = None) -> int:
    """Total parameters: embedding, layers, final norm, untied head, learned positions."""
    vocab, h = cfg.vocab_size or 0, cfg.hidden_size
    total = vocab * h + cfg.num_layers * layer_parameters(cfg, arch, head_dim) + arch.norm_parameters_per_width * h
    if arch.position_embedding == "learned":
        total += cfg.max_position_embeddings * h
    if not cfg.tie_word_embeddings:
        total += vocab * h
    return total


def attention_matmul_parameters(cfg: ModelConfig, head_dim: Optional[int] = None) -> int:
    """Weights of one layer's q, k, v and output projections (no biases)."""
    d = _head_dim(cfg, head_dim)
    return 2 * cfg.hidden_size * (cfg.num_attention_heads + cfg.kv_heads) * d


def matmul_parameters(cfg: ModelConfig, arch: DecoderArch, head_dim: Optional[int] = None) -> int:
    """Parameters that take part in matrix multiplies: layers' weights and the output head (PaLM's N)."""
    per_layer = attention_matmul_parameters(cfg, head_dim) + arch.mlp_matrices * cfg.hidden_size * cfg.ffn_size
    return cfg.num_layers * per_layer + (cfg.vocab_size or 0) * cfg.hidden_size


def palm_flops_per_token(
    matmul_params: int, cfg: ModelConfig, seq_length: int, head_dim: Optional[int] = None
) -> float:
    """Training FLOPs per token by the PaLM formula: 6N + 12 L H Q T (recompute not counted)."""
    attention = cfg.num_layers * cfg.num_attention_heads * _head_dim(cfg, head_dim) * seq_length
    return 6.0 * matmul_params + 12.0 * attention


def flops_per_token(cfg: ModelConfig, seq_length: int, arch: DecoderArch, head_dim: Optional[int] = None) -> float:
    """PaLM FLOPs per token of a decoder model."""
    return palm_flops_per_token(matmul_parameters(cfg, arch, head_dim), cfg, seq_length, head_dim)
