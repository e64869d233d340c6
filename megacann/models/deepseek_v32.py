"""DeepSeek-V3.2 (``model.type: deepseek_v32``; Hugging Face ``model_type: deepseek_v32``): DeepSeek-V3 whose
latent attention is sparse (DSA).

    tokens -> embed_tokens -> layers[i] (LatentAttention reading the keys its SparseIndexer picks, then the
              dense MLP or the MoE layer of DeepSeek-V3) ... -> norm -> lm_head

Every layer's :class:`~megacann.layers.sparse_indexer.SparseIndexer` (``index_n_heads`` heads of width
``index_head_dim``, RoPE on its first ``qk_rope_head_dim`` columns) scores the causal keys of each query and
the attention reads the best ``index_topk`` (all of them when the sequence is no longer: DeepSeek-V3's
dense path). Training follows DeepSeek's two stages: ``indexer_warmup: true`` attends densely and freezes
every weight but the indexers', which learn the dense attention's distribution; after it, sparse attention
trains the model on the language loss and the indexers on their KL loss over the chosen keys (inputs
detached), weighted by ``indexer_loss_coeff`` and summed over layers as the auxiliary loss
``indexer_kl``. Under context parallelism the indexer scores and picks over the all-gathered keys
(``distributed.context_parallel_algo: allgather``; ring and Ulysses are refused), exactly as on one process
(:mod:`megacann.layers.indexed_attention`). Generation caches each token's index key beside its latent
and selects each new token's ``index_topk`` over the cached ones.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.config.validation import require_context_parallel_algo
from megacann.layers import LatentAttention
from megacann.layers.indexed_attention import INDEXED_CONTEXT_PARALLEL_ALGO
from megacann.layers.init import init_normal
from megacann.layers.sparse_indexer import SparseIndexer
from megacann.models.contract import ChunkOutput
from megacann.models.decode_cache import LayerCache
from megacann.models.deepseek import (
    DeepseekV3Model,
    check_deepseek_config,
    deepseek_decode_cache,
    deepseek_flops_per_token,
    deepseek_num_parameters,
    deepseek_structure,
)
from megacann.models.deepseek_v32_config import DeepseekV32ModelConfig
from megacann.models.hf_deepseek_v32 import DEEPSEEK_V32_HF
from megacann.models.moe import moe_forward_step, moe_model_spec
from megacann.models.mtp import mtp_depths
from megacann.models.spec import Batch

INDEXER_LOSS = "indexer_kl"  # the auxiliary loss's name in a chunk's output


class DeepseekV32Model(DeepseekV3Model):
    """One pipeline stage of a DeepSeek-V3.2 model (see the module docstring); each layer's indexer is
    ``layers.<i>.self_attn.indexer.*``. Under ``indexer_warmup`` only the indexers' weights are trainable."""

    def __init__(self, cfg: ModelConfig, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        if self.config.indexer_warmup:
            for name, param in self.named_parameters():
                param.requires_grad_(".indexer." in name)

    def attention_options(self) -> dict:
        c = self.config
        indexer = SparseIndexer(
            c.hidden_size,
            c.q_lora_rank,
            c.index_n_heads,
            c.index_head_dim,
            c.qk_rope_head_dim,
            c.index_topk,
            init_method=init_normal(self.block_config.init_method_std),
        )
        return dict(indexer=indexer, indexer_dense=c.indexer_warmup, indexer_loss_coeff=c.indexer_loss_coeff)


def indexer_loss(chunk: torch.nn.Module) -> Optional[torch.Tensor]:
    """The weighted indexer losses of the chunk's last training forward, summed over its layers."""
    losses = [m.last_indexer_loss for m in chunk.modules() if isinstance(m, LatentAttention)]
    losses = [loss for loss in losses if loss is not None]
    return sum(losses) if losses else None


def deepseek_v32_forward_step(
    chunk: torch.nn.Module, batch: Batch, hidden_states: Optional[torch.Tensor]
) -> ChunkOutput:
    """The MoE family's forward step, plus the indexers' loss as the auxiliary loss ``indexer_kl``."""
    out = moe_forward_step(chunk, batch, hidden_states)
    loss = indexer_loss(chunk)
    if loss is not None:
        out.aux_losses[INDEXER_LOSS] = loss
    return out


def check_deepseek_v32_config(cfg: MegacannConfig, source: str) -> None:
    """What DeepSeek-V3.2 needs beyond DeepSeek-V3 (the indexer's sizes, the low-rank query, interleaved
    RoPE), what it refuses (context parallelism other than all-gather), then DeepSeek-V3's checks."""
    m = cfg.model
    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        if getattr(m, key) < 1:
            raise ConfigError(f"{source}: model.{key} must be >= 1, got {getattr(m, key)}")
    if m.index_head_dim < m.qk_rope_head_dim:
        raise ConfigError(
            f"{source}: model.index_head_dim {m.index_head_dim} must be >= qk_rope_head_dim {m.qk_rope_head_dim} "
            "(the indexer rotates its first qk_rope_head_dim columns)"
        )
    if m.q_lora_rank is None:
        raise ConfigError(
            f"{source}: model.q_lora_rank null is refused for deepseek_v32 (the indexer reads the query latent)"
        )
    if not m.rotary_interleaved:
        raise ConfigError(
            f"{source}: model.rotary_interleaved false is refused: DeepSeek-V3.2 rotates interleaved pairs"
        )
    if m.indexer_loss_coeff < 0 or (m.indexer_warmup and m.indexer_loss_coeff == 0):
        raise ConfigError(
            f"{source}: model.indexer_loss_coeff {m.indexer_loss_coeff} must be >= 0, and > 0 under "
            "indexer_warmup (the warm-up trains the indexers on that loss alone)"
        )
    if m.attention_dropout:
        raise ConfigError(
            f"{source}: model.attention_dropout {m.attention_dropout} is refused for deepseek_v32 (0 only)"
        )
    needs = "its indexer picks each query's keys from the whole sequence"
    require_context_parallel_algo(cfg, source, INDEXED_CONTEXT_PARALLEL_ALGO, needs)
    check_deepseek_config(cfg, source)


def indexer_parameters(m: ModelConfig) -> int:
    """Parameters of one layer's indexer: wq_b, wk, k_norm (weight and bias), weights_proj."""
    heads, width = m.index_n_heads, m.index_head_dim
    return m.q_lora_rank * heads * width + m.hidden_size * width + 2 * width + m.hidden_size * heads


def deepseek_v32_num_parameters(m: ModelConfig, active: bool = False) -> int:
    """DeepSeek-V3's count plus every layer's indexer (multi-token prediction depths included)."""
    return deepseek_num_parameters(m, active) + (m.num_layers + mtp_depths(m)) * indexer_parameters(m)


def deepseek_v32_flops_per_token(m: ModelConfig, seq_length: int) -> float:
    """DeepSeek-V3's (its dense attention: an upper bound) plus 6x the indexers' matrix weights."""
    layers = m.num_layers + mtp_depths(m)
    return deepseek_flops_per_token(m, seq_length) + 6.0 * layers * (indexer_parameters(m) - 2 * m.index_head_dim)


def deepseek_v32_decode_cache(m: ModelConfig) -> list[LayerCache]:
    """DeepSeek-V3's latent cache, with each token's index key (one head of ``index_head_dim``) beside it."""
    return [dataclasses.replace(kind, index_head_dim=m.index_head_dim) for kind in deepseek_decode_cache(m)]


DEEPSEEK_V32 = dataclasses.replace(
    moe_model_spec(
        "deepseek_v32",
        DeepseekV32Model,
        config_class=DeepseekV32ModelConfig,
        check_config=check_deepseek_v32_config,
        hf=DEEPSEEK_V32_HF,
        num_parameters=deepseek_v32_num_parameters,
        flops_per_token=deepseek_v32_flops_per_token,
        structure=deepseek_structure,
    ),
    forward_step=deepseek_v32_forward_step,
    architecture=dataclasses.replace(DeepseekV32Model.ARCH, sparse_indexer=True),
    decode_cache=deepseek_v32_decode_cache,
)

__all__ = ["DEEPSEEK_V32", "DeepseekV32Model", "deepseek_v32_num_parameters"]
