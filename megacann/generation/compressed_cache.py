"""The cache of a DeepSeek-V4 attention layer (:class:`~megacann.layers.CompressedSparseAttention`) while
generating: each token's rotated KV head in a rolling cache of ``sliding_window`` slots and, on the
compressed layer types, each token's compressor projections (candidates and gates; for compressed sparse
attention its indexer's as well) for the whole row.

Every forward, the prefill included, attends over the local keys (the prefill over its own fresh keys, a
later step over the rolling cache) and the compressed entries of its row's closed windows, pooled again
from the cached projections. Rows are left-padded, so before pooling each row's projections are shifted
to start at its first real token: its windows are its own (position 0 at the first real token, as the
positions the generator gives). Tokens past a row's end fill only windows that close after every query
of the row, which no query reads; the indexer ranks only a row's own entries, so a padded row picks
what it picks alone (top-k breaks ties among equal scores by how many entries it ranks). Under tensor
parallelism every rank caches the whole KV head and projections (one KV head serves all heads) and
attends with its own heads.
"""

from __future__ import annotations

from typing import Optional

import torch

from megacann import ops
from megacann.generation.kv_cache import CacheLayer, KVCache, register_cache_layer
from megacann.layers import CompressedSparseAttention
from megacann.models.decode_cache import CompressedWindow


def compressed_cache_bytes(
    num_layers: int,
    batch: int,
    max_len: int,
    head_dim: int,
    sliding_window: int,
    projection_width: int,
    dtype: torch.dtype,
) -> int:
    """Bytes of the caches of ``num_layers`` layers of one type for ``batch`` rows of ``max_len`` tokens:
    ``min(sliding_window, max_len)`` KV heads of ``head_dim`` a row, and ``projection_width`` values a
    token of compressor projections (``0`` on sliding layers; ``2·head_dim`` for HCA's candidates and
    gates, ``2·(2·head_dim + 2·index_head_dim)`` for CSA's and its indexer's): the same on every
    tensor-parallel rank (:class:`~megacann.models.decode_cache.CompressedWindow`'s formula, which the
    planners use too)."""
    kind = CompressedWindow(head_dim, sliding_window, projection_width)
    return num_layers * kind.nbytes(batch, max_len, dtype)


class CompressedAttentionCacheLayer:
    """One :class:`CompressedSparseAttention`'s rows of a :class:`KVCache`: ``local`` (the rotated KV head,
    rolling over ``sliding_window`` slots) and ``history`` (the compressor's projections, every slot;
    None on sliding layers). A forward of several tokens after cached ones (``extendable``) reads the
    window as held before it, then its own tokens, and pools the compressed entries again from every
    cached projection: a window left partial by the cached tokens closes with the new ones."""

    extendable = True

    def __init__(self, cache: KVCache, attention: CompressedSparseAttention, batch: int):
        self.cache = cache
        self.local = CacheLayer(cache, batch, attention.sliding_window)
        self.history = CacheLayer(cache, batch, None) if attention.compressor is not None else None

    @property
    def nbytes(self) -> int:
        return self.local.nbytes + (self.history.nbytes if self.history is not None else 0)

    def keep_rows(self, rows: torch.Tensor) -> None:
        for part in (self.local, self.history):
            if part is not None:
                part.keep_rows(rows)

    def attend(
        self,
        attention: CompressedSparseAttention,
        q: torch.Tensor,
        kv: torch.Tensor,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Store this forward's KV heads (and projections), then attend (see the module docstring)."""
        start, s = self.cache.length, q.shape[1]
        if start == 0:
            self.local.store(kv)
            keys, read = kv, self._prefill_mask(s, attention.sliding_window, q.device)
        else:
            (keys,), read = self.local.store_and_read(kv)
        if self.history is not None:
            entries, index_keys = self._entries(attention, x, start + s)
            row_entries = (start + s - self.cache.pad) // attention.compressor.compress_rate  # closed by each row
            entries_read = attention.entries_read(
                entries.shape[1], x, q_residual, position_ids, index_keys, row_entries
            )
            keys = torch.cat([keys, entries.unsqueeze(2)], dim=1)
            read = torch.cat([read, entries_read], dim=-1)
        scale = attention.head_dim**-0.5
        return ops.decode_attention(q, keys, keys, attn_mask=read, scale=scale, sinks=attention.sinks)

    def _prefill_mask(self, s: int, window: int, device: torch.device) -> torch.Tensor:
        """``[b, 1, s, s]``: a prompt token reads the tokens of its window that are not padding; a padding
        token (whose output nobody reads) reads itself alone."""
        slots = torch.arange(s, device=device)
        query, key = slots.view(-1, 1), slots.view(1, -1)
        in_window = (key <= query) & (key > query - window)
        real = key.unsqueeze(0) >= self.cache.pad.view(-1, 1, 1)
        return (in_window & (real | (key == query))).unsqueeze(1)

    def _entries(
        self, attention: CompressedSparseAttention, x: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Store this forward's projections; the compressed entries ``[b, T, head_dim]`` of every row's
        first ``length`` tokens counted from its first real one, and the indexer's keys (CSA; else None)."""
        compressor = attention.compressor
        indexer = getattr(compressor, "indexer", None)
        projections = compressor.project(x) + (indexer.project(x) if indexer is not None else ())
        self.history.store(*projections)
        shift = (torch.arange(length, device=x.device).unsqueeze(0) + self.cache.pad.unsqueeze(1)).clamp(max=length - 1)
        aligned = [entry[:, :length].gather(1, shift.unsqueeze(-1).expand(-1, -1, entry.shape[-1])) for entry in
                   self.history.entries]  # fmt: skip
        entries = compressor.pool(aligned[0], aligned[1], attention.rotary)
        index_keys = indexer.pool(aligned[2], aligned[3], attention.rotary) if indexer is not None else None
        return entries, index_keys


register_cache_layer(CompressedSparseAttention, CompressedAttentionCacheLayer)
