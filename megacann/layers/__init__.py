"""Tensor- and sequence-parallel building blocks for custom models.

Everything here takes its process group from :mod:`megacann.parallel_state` (or a ``group`` argument)
and works in a plain one-process script when model parallelism is not initialised. Activations are
batch-first, ``[batch, seq, hidden]``; sequence parallelism splits the sequence (dim 1). See
``docs/layers.md`` for a complete example.
"""

from megacann.layers.attention import SelfAttention
from megacann.layers.cross_entropy import vocab_parallel_cross_entropy
from megacann.layers.embedding import VocabParallelEmbedding, pad_vocab_size
from megacann.layers.init import init_normal, init_ones, init_scaled_normal, init_zeros, make_parameter
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
from megacann.layers.norm import LayerNorm, RMSNorm
from megacann.layers.random import (
    RNGStatesTracker,
    checkpoint,
    dropout,
    get_rng_tracker,
    model_parallel_manual_seed,
)
from megacann.layers.rotary import RotaryEmbedding, rope_inv_freq
from megacann.layers.sharding import ParamSharding, get_sharding, set_sharding
from megacann.layers.transformer import TransformerBlock, TransformerBlockConfig

__all__ = [
    "SEQUENCE_DIM",
    "ColumnParallelLinear",
    "GeluMLP",
    "LayerNorm",
    "ParamSharding",
    "RMSNorm",
    "RNGStatesTracker",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SelfAttention",
    "SwiGLUMLP",
    "TransformerBlock",
    "TransformerBlockConfig",
    "VocabParallelEmbedding",
    "checkpoint",
    "copy_to_tensor_model_parallel_region",
    "dropout",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_rng_tracker",
    "get_sharding",
    "init_normal",
    "init_ones",
    "init_scaled_normal",
    "init_zeros",
    "make_parameter",
    "model_parallel_manual_seed",
    "pad_vocab_size",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "rope_inv_freq",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_sharding",
    "sync_partial_grads",
    "vocab_parallel_cross_entropy",
    # LoRA adapters on the parallel linear layers
    "FUSED_PROJECTIONS",
    "LoRAAdapter",
    "LoRAConfig",
    "attach_lora",
    "count_parameters",
    "init_adapters_",
    "is_lora_parameter",
    "lora_adapters",
    "lora_parameters",
    "merge_lora",
    "unload_lora",
    "unmerge_lora",
]
