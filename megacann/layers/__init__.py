"""Tensor- and sequence-parallel building blocks for custom models.

Everything here takes its process group from :mod:`megacann.parallel_state` (or a ``group`` argument)
and works in a plain one-process script when model parallelism is not initialised. Activations are
batch-first, ``[batch, seq, hidden]``; sequence parallelism splits the sequence (dim 1). How layers are
built on this process (sequence parallel, dtype, device, the context-parallel algorithm, initialisation,
recompute) is said once by a :class:`LayerContext` (``with LayerContext(...): ...``; a recipe's is
``megacann.models.layer_context_from_config(cfg, device)``) instead of in every constructor. docs/layers.md
shows a complete model and how to make the trainer run it.

The names below are what a model author needs. The rest lives in subpackages:
:mod:`megacann.layers.lora` (LoRA adapters), :mod:`megacann.layers.context_parallel` (the sequence split
across the cp group and attention by ring, all-gather or all-to-all; docs/context_parallel.md),
:mod:`megacann.layers.moe` (router, dispatcher, experts, balancing), :mod:`megacann.layers.mappings`
(the autograd collectives), :mod:`megacann.layers.sharding` (parameter sharding metadata).
"""

from megacann.layers.attention import SelfAttention
from megacann.layers.compile import compile_blocks
from megacann.layers.compressed_attention import CompressedSparseAttention
from megacann.layers.compressed_indexer import CompressedIndexer, chosen_entries_bias
from megacann.layers.context import LayerContext, current_layer_context
from megacann.layers.embedding import VocabParallelEmbedding
from megacann.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetCache
from megacann.layers.grouped_output_projection import GroupedOutputProjection
from megacann.layers.hyper_connections import HyperConnection, HyperHead
from megacann.layers.init import (
    deferred_initialization,
    init_normal,
    init_ones,
    init_scaled_normal,
    init_zeros,
    initialize_undrawn,
    initialize_weights,
    make_parameter,
    parameter_seed,
)
from megacann.layers.latent_attention import LatentAttention
from megacann.layers.linear import ColumnParallelLinear, RowParallelLinear
from megacann.layers.loss import (
    IGNORE_INDEX,
    token_loss,
    vocab_parallel_cross_entropy,
)
from megacann.layers.mappings import sync_partial_grads
from megacann.layers.mlp import GeluMLP, SwiGLUMLP
from megacann.layers.moe import MoEConfig, MoELayer
from megacann.layers.multi_token_prediction import MTPLayer, MultiTokenPrediction, embedding_copy_for_last_stage
from megacann.layers.norm import LayerNorm, RMSNorm
from megacann.layers.output import LMHead, tie_embedding_across_stages
from megacann.layers.random import checkpoint, dropout, get_rng_tracker, model_parallel_manual_seed
from megacann.layers.rotary import RotaryEmbedding
from megacann.layers.transformer import TransformerBlock, TransformerBlockConfig
from megacann.layers.window_compressor import WindowCompressor, compressed_causal_bias

__all__ = [
    # how this process builds layers: sequence parallel, dtype, device, CP algorithm, init, recompute
    "LayerContext",
    "current_layer_context",
    # linear layers, the embedding and the output head
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "LMHead",
    "tie_embedding_across_stages",
    # the loss
    "IGNORE_INDEX",
    "token_loss",
    "vocab_parallel_cross_entropy",
    # norms, positions, attention, feed-forward blocks, the transformer block
    "RMSNorm",
    "LayerNorm",
    "RotaryEmbedding",
    "SelfAttention",
    "LatentAttention",
    "GatedDeltaNet",
    "GatedDeltaNetCache",
    "CompressedSparseAttention",
    "GroupedOutputProjection",
    "HyperConnection",
    "WindowCompressor",
    "CompressedIndexer",
    "chosen_entries_bias",
    "compressed_causal_bias",
    "HyperHead",
    "SwiGLUMLP",
    "GeluMLP",
    "TransformerBlock",
    "TransformerBlockConfig",
    "MoEConfig",
    "MoELayer",
    # multi-token prediction (DeepSeek-V3): extra depths on the last stage, their loss
    "MTPLayer",
    "MultiTokenPrediction",
    "embedding_copy_for_last_stage",
    # initialisation
    "make_parameter",
    "initialize_weights",
    "initialize_undrawn",
    "deferred_initialization",
    "parameter_seed",
    "init_normal",
    "init_scaled_normal",
    "init_zeros",
    "init_ones",
    # RNG, dropout and recompute
    "model_parallel_manual_seed",
    "get_rng_tracker",
    "dropout",
    "checkpoint",
    # gradients of parameters each TP rank sees only part of; torch.compile per block
    "sync_partial_grads",
    "compile_blocks",
]
