"""Tensor- and sequence-parallel building blocks for custom models.

Everything here takes its process group from :mod:`megacann.parallel_state` (or a ``group`` argument)
and works in a plain one-process script when model parallelism is not initialised. Activations are
batch-first, ``[batch, seq, hidden]``; sequence parallelism splits the sequence (dim 1). docs/layers.md
shows a complete model and how to make the trainer run it. Context parallelism (the sequence split across
the cp group, attention by ring, all-gather or all-to-all) is in :mod:`megacann.layers.context_parallel`,
see docs/context_parallel.md.
"""

from megacann.layers.attention import SelfAttention
from megacann.layers.compile import compile_blocks
from megacann.layers.context_parallel import (
    CONTEXT_PARALLEL_ALGORITHMS,
    context_parallel_attention,
    context_parallel_batch,
    context_parallel_chunk_ids,
    context_parallel_gather,
    context_parallel_position_ids,
    context_parallel_split,
)
from megacann.layers.embedding import VocabParallelEmbedding, pad_vocab_size
from megacann.layers.init import (
    init_normal,
    init_ones,
    init_scaled_normal,
    init_zeros,
    initialize_weights,
    make_parameter,
    parameter_seed,
)
from megacann.layers.linear import ColumnParallelLinear, RowParallelLinear
from megacann.layers.lora import (
    FUSED_PROJECTIONS,
    LoRAAdapter,
    LoRAConfig,
    attach_lora,
    count_parameters,
    init_adapters_,
    is_lora_parameter,
    lora_adapters,
    lora_parameters,
    merge_lora,
    unload_lora,
    unmerge_lora,
)
from megacann.layers.loss import (
    IGNORE_INDEX,
    ChunkOutput,
    token_loss,
    vocab_parallel_cross_entropy,
)
from megacann.layers.mappings import (
    SEQUENCE_DIM,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    sync_partial_grads,
)
from megacann.layers.mlp import GeluMLP, SwiGLUMLP
from megacann.layers.moe import (
    MoEConfig,
    MoELayer,
    MoEStats,
    TokenDispatcher,
    TopKRouter,
    moe_aux_loss,
    moe_layers,
    update_expert_biases,
)
from megacann.layers.norm import LayerNorm, RMSNorm
from megacann.layers.output import LMHead, tie_embedding_across_stages
from megacann.layers.random import (
    RNGStatesTracker,
    checkpoint,
    dropout,
    get_rng_tracker,
    model_parallel_manual_seed,
)
from megacann.layers.rotary import RotaryEmbedding, rope_inv_freq
from megacann.layers.sharding import ParamSharding, get_sharding, mark_tied_across_stages, set_sharding
from megacann.layers.transformer import TransformerBlock, TransformerBlockConfig

__all__ = [
    # modules: embedding, blocks and their parts, the output head
    "VocabParallelEmbedding",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SelfAttention",
    "SwiGLUMLP",
    "GeluMLP",
    "RMSNorm",
    "LayerNorm",
    "RotaryEmbedding",
    "TransformerBlock",
    "TransformerBlockConfig",
    "LMHead",
    # the loss
    "IGNORE_INDEX",
    "ChunkOutput",
    "token_loss",
    "vocab_parallel_cross_entropy",
    # initialisation and tied embeddings
    "make_parameter",
    "initialize_weights",
    "parameter_seed",
    "init_normal",
    "init_scaled_normal",
    "init_zeros",
    "init_ones",
    "tie_embedding_across_stages",
    "pad_vocab_size",
    "rope_inv_freq",
    # LoRA adapters on the parallel linear layers
    "LoRAConfig",
    "LoRAAdapter",
    "attach_lora",
    "init_adapters_",
    "merge_lora",
    "unmerge_lora",
    "unload_lora",
    "lora_adapters",
    "lora_parameters",
    "is_lora_parameter",
    "count_parameters",
    "FUSED_PROJECTIONS",
    # mixture of experts
    "MoEConfig",
    "MoELayer",
    "MoEStats",
    "TopKRouter",
    "TokenDispatcher",
    "moe_aux_loss",
    "moe_layers",
    "update_expert_biases",
    # context parallelism
    "CONTEXT_PARALLEL_ALGORITHMS",
    "context_parallel_attention",
    "context_parallel_batch",
    "context_parallel_split",
    "context_parallel_gather",
    "context_parallel_position_ids",
    "context_parallel_chunk_ids",
    # collectives with autograd (tensor and sequence parallel regions)
    "SEQUENCE_DIM",
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "sync_partial_grads",
    # RNG, dropout and recompute
    "RNGStatesTracker",
    "get_rng_tracker",
    "model_parallel_manual_seed",
    "dropout",
    "checkpoint",
    # torch.compile per transformer block
    "compile_blocks",
    # sharding metadata
    "ParamSharding",
    "get_sharding",
    "set_sharding",
    "mark_tied_across_stages",
]
