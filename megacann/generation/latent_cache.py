"""The cache of a latent attention layer (DeepSeek-V2 / V3's MLA) while generating: per token only the
normed compressed latent (``kv_lora_rank`` values) and the rotary key shared by all heads
(``qk_rope_head_dim`` values), side by side in one ``[batch, slots, kv_lora_rank + qk_rope_head_dim]``
tensor, not every head's keys and values.

The prefill attends the ordinary way (each head's keys and values expanded from the latent, the training
kernels, padding as its own segment) and writes the latents; each later step attends over the cached
latents with the up-projections absorbed into the query and the output
(:meth:`~megacann.layers.LatentAttention.absorbed_attention`). Under tensor parallelism the latent serves
every head, so each rank caches all of it and applies its own heads' share of the up-projection.
"""

from __future__ import annotations

from typing import Optional

import torch

from megacann.generation.kv_cache import CacheLayer, KVCache, register_cache_layer
from megacann.layers import LatentAttention
from megacann.layers.latent_attention import IndexInputs
from megacann.models.decode_cache import CompressedLatent
from megacann.ops.reference import attention_mask


def latent_cache_bytes(
    num_layers: int, batch: int, max_len: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of the latent caches of ``num_layers`` layers for ``batch`` rows of ``max_len`` tokens (the
    same on every tensor-parallel rank; :class:`~megacann.models.decode_cache.CompressedLatent`'s formula,
    which also counts a sparse indexer's keys)."""
    return num_layers * CompressedLatent(kv_lora_rank, qk_rope_head_dim).nbytes(batch, max_len, dtype)


class LatentCacheLayer(CacheLayer):
    """One :class:`LatentAttention`'s cached tokens, ``latents`` ``[batch, slots, kv_lora_rank +
    qk_rope_head_dim]`` (each token's normed latent, then its rotary key)."""

    def __init__(self, cache: KVCache, attention: LatentAttention, batch: int):
        super().__init__(cache, batch, window=None)

    @property
    def latents(self) -> Optional[torch.Tensor]:
        return self.entries[0] if self.entries else None

    @property
    def index_keys(self) -> Optional[torch.Tensor]:
        """``[batch, slots, index_head_dim]``: a sparse indexer's keys (DeepSeek-V3.2), None without one."""
        return self.entries[1] if len(self.entries) > 1 else None

    def attend(
        self,
        attention: LatentAttention,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        index: Optional[IndexInputs] = None,
    ) -> torch.Tensor:
        """Store this step's latents and rotary keys (and index keys), then attend: the prefill over itself
        with expanded keys and values, a later step over the cache with the up-projections absorbed; with
        an indexer each query reads only its ``top_k`` best-scored tokens of its row."""
        start, s = self.cache.length, q_nope.shape[1]
        stored = [torch.cat([latent, k_rope.squeeze(2)], -1)]
        if index is not None:
            stored.append(index.keys(attention))
        self.store(*stored)
        sparse = index is not None and not attention.indexer_dense
        if start == 0:
            q = torch.cat([q_nope, q_rope], -1)
            k, v = attention.expand_latent(latent, k_rope)
            segments = self.padding_segments(s, q.device)
            if not (sparse and attention.indexer.top_k < s):
                return attention.core_attention(q, k, v, segments, whole_sequence=True)
            read = attention.indexer.select(
                index.scores(attention, stored[1]), attention_mask(s, True, segments, q.device)
            )
            return attention.sparse_attention(q, k, v, read)
        used = self.used(s)
        mask = self.mask(s, used)
        if sparse:
            mask = attention.indexer.select(index.scores(attention, self.index_keys[:, :used]), mask)
        return attention.absorbed_attention(q_nope, q_rope, self.latents[:, :used], mask)


register_cache_layer(LatentAttention, LatentCacheLayer)
