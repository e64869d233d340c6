"""Parameter counts and training FLOPs of decoder models, from their config alone (no weights needed)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megacann.config import ModelConfig
from megacann.layers.embedding import pad_vocab_size

if TYPE_CHECKING:
    from megacann.models.decoder import DecoderArch

padded_vocab_size = pad_vocab_size  # the vocabulary as VocabParallelEmbedding pads it


def attention_head_dim(cfg: ModelConfig) -> int:
    """Width of one attention head: the family's ``head_dim`` key where it has one and sets it (Mistral),
    else ``hidden_size / num_attention_heads``."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def attention_parameters(cfg: ModelConfig, arch: Optional[DecoderArch] = None) -> int:
    """q, k, v and output projections of one layer, with the biases the model has (``arch.qkv_bias``: on
    q, k, v apart from the other projections) and ``arch.qk_norm``'s per-head norms."""
    h, head_dim = cfg.hidden_size, attention_head_dim(cfg)
    q, kv = cfg.num_attention_heads * head_dim, cfg.kv_heads * head_dim
    qkv_bias = cfg.use_bias if arch is None or arch.qkv_bias is None else arch.qkv_bias
    total = h * q + 2 * h * kv + q * h + (q + 2 * kv if qkv_bias else 0) + (h if cfg.use_bias else 0)
    return total + (2 * head_dim if arch is not None and arch.qk_norm else 0)


def layer_parameters(cfg: ModelConfig, arch: DecoderArch) -> int:
    """Parameters of one transformer layer: attention, MLP and two norms."""
    h, ffn = cfg.hidden_size, cfg.ffn_size
    mlp = arch.mlp_matrices * h * ffn + ((arch.mlp_matrices - 1) * ffn + h if cfg.use_bias else 0)
    return attention_parameters(cfg, arch) + mlp + 2 * arch.norm_parameters_per_width * h


def num_parameters(cfg: ModelConfig, arch: DecoderArch) -> int:
    """Total parameters: embedding, layers, final norm, untied head, learned positions."""
    vocab, h = cfg.vocab_size or 0, cfg.hidden_size
    total = vocab * h + cfg.num_layers * layer_parameters(cfg, arch) + arch.norm_parameters_per_width * h
    if arch.position_embedding == "learned":
        total += cfg.max_position_embeddings * h
    if not cfg.tie_word_embeddings:
        total += vocab * h
    return total


def attention_matmul_parameters(cfg: ModelConfig) -> int:
    """Weights of one layer's q, k, v and output projections (no biases)."""
    h, head_dim = cfg.hidden_size, attention_head_dim(cfg)
    q, kv = cfg.num_attention_heads * head_dim, cfg.kv_heads * head_dim
    return 2 * h * q + 2 * h * kv


def matmul_parameters(cfg: ModelConfig, arch: DecoderArch) -> int:
    """Parameters that take part in matrix multiplies: layers' weights and the output head (PaLM's N)."""
    per_layer = attention_matmul_parameters(cfg) + arch.mlp_matrices * cfg.hidden_size * cfg.ffn_size
    return cfg.num_layers * per_layer + (cfg.vocab_size or 0) * cfg.hidden_size


def palm_flops_per_token(matmul_params: int, cfg: ModelConfig, seq_length: int, extra_layers: int = 0) -> float:
    """Training FLOPs per token by the PaLM formula: 6N + 12 L H Q T (recompute not counted);
    ``extra_layers``: attention layers besides the model's (multi-token prediction's)."""
    head_dim = attention_head_dim(cfg)
    layers = cfg.num_layers + extra_layers
    return 6.0 * matmul_params + 12.0 * layers * cfg.num_attention_heads * head_dim * seq_length


def flops_per_token(cfg: ModelConfig, seq_length: int, arch: DecoderArch) -> float:
    """PaLM FLOPs per token of a decoder model."""
    return palm_flops_per_token(matmul_parameters(cfg, arch), cfg, seq_length)
