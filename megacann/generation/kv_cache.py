"""The key/value cache of a generation: one preallocated ``[batch, slots, kv_heads, head_dim]`` pair per
attention layer, shared bookkeeping for all of them, and the attention that reads it.

Rows are left-padded to a common length, so every row writes its token of a step into the same slot;
``pad[row]`` says where its real tokens begin, and no query ever reads a slot before it. The first
forward (the prefill) attends with the training attention (``segment_ids``: padding 0, prompt 1, so no
``[s, s]`` mask on CPU); later ones attend over the cache with a ``[b, 1, s, slots]`` mask. A layer with a
sliding window W keeps a rolling cache of ``min(W, max_len)`` slots: a token at slot ``t`` lives at
``t mod W`` and overwrites the one that left the window. Under tensor parallelism each rank caches the kv
heads its query heads read (``SelfAttention.local_kv_heads``): the cache is sharded by heads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch

from megacann import ops
from megacann.layers import SelfAttention


def kv_cache_bytes(
    num_layers: int,
    batch: int,
    max_len: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    sliding_window: Optional[int] = None,
) -> int:
    """Bytes of the keys and values of ``num_layers`` layers for ``batch`` rows of ``max_len`` tokens
    (``kv_heads``: those one rank holds); a sliding window W keeps ``min(W, max_len)`` tokens a row."""
    slots = min(max_len, sliding_window) if sliding_window else max_len
    return 2 * num_layers * batch * slots * kv_heads * head_dim * dtype.itemsize


class KVCache:
    """The caches of every :class:`SelfAttention` of ``model`` for ``batch`` rows of at most ``max_len``
    tokens (prompt, padding and new tokens), allocated at once. ``pad`` ``[batch]``: each row's padding.
    :meth:`attached` sets them on the layers for the forwards of a generation; :meth:`advance` moves past
    the tokens a forward wrote; :meth:`keep_rows` drops finished rows."""

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, pad: torch.Tensor):
        self.attentions = [m for m in model.modules() if isinstance(m, SelfAttention)]
        if not self.attentions:
            raise ValueError("the model has no SelfAttention layer whose keys and values a cache could hold")
        self.max_len, self.length, self.pad = max_len, 0, pad
        self.layers = [KVCacheLayer(self, attention, batch) for attention in self.attentions]

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (keys and values of every layer on this rank)."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)

    @contextlib.contextmanager
    def attached(self) -> Iterator[KVCache]:
        """The model's attention layers read and write this cache inside the block, and not after it."""
        for attention, layer in zip(self.attentions, self.layers):
            attention.kv_cache = layer
        try:
            yield self
        finally:
            for attention in self.attentions:
                attention.kv_cache = None

    def advance(self, tokens: int) -> None:
        """The last forward wrote ``tokens`` slots of every row."""
        self.length += tokens

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current batch): finished requests cost nothing more."""
        self.pad = self.pad.index_select(0, rows)
        for layer in self.layers:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)


class KVCacheLayer:
    """One attention layer's keys and values (``[batch, slots, local_kv_heads, head_dim]``) and the slot
    each cache position holds (``slot_of``, -1: empty)."""

    def __init__(self, cache: KVCache, attention: SelfAttention, batch: int):
        self.cache, self.window = cache, attention.sliding_window
        slots = min(cache.max_len, self.window) if self.window else cache.max_len
        weight = attention.o_proj.weight
        shape = (batch, slots, attention.local_kv_heads, attention.head_dim)
        self.keys = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.values = torch.zeros_like(self.keys)
        self.slot_of = torch.full((slots,), -1, dtype=torch.long, device=weight.device)

    @property
    def rolling(self) -> bool:
        return self.keys.shape[1] < self.cache.max_len

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        start, s, slots = self.cache.length, k.shape[1], self.keys.shape[1]
        if start + s > self.cache.max_len:
            raise ValueError(f"the key/value cache holds {self.cache.max_len} tokens a row; {start + s} asked")
        keep = min(s, slots)  # a rolling cache keeps the last W of a long prompt
        positions = torch.arange(start + s - keep, start + s, device=k.device)
        where = positions % slots
        self.keys[:, where] = k[:, s - keep :].to(self.keys.dtype)
        self.values[:, where] = v[:, s - keep :].to(self.values.dtype)
        self.slot_of[where] = positions

    def attend(self, attention: SelfAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's keys and values, then attend: the prefill over itself (the training kernels,
        padding as its own segment), a later step over the cache."""
        start, s = self.cache.length, q.shape[1]
        self._store(k, v)
        if start == 0:
            columns = torch.arange(s, device=q.device)
            segment_ids = (columns.unsqueeze(0) >= self.cache.pad.unsqueeze(1)).long()
            return attention.core_attention(q, *attention.expand_kv(k, v), segment_ids)
        used = self.keys.shape[1] if self.rolling else start + s  # a full cache's empty tail is not read
        mask = self._mask(torch.arange(start, start + s, device=q.device), used)
        keys, values = attention.expand_kv(self.keys[:, :used], self.values[:, :used])
        return ops.decode_attention(q, keys, values, attn_mask=mask, scale=attention.softmax_scale)

    def _mask(self, query_slots: torch.Tensor, used: int) -> torch.Tensor:
        """``[b, 1, s, used]``, True where a query may read a cached key: a key of its own row (not
        padding), not after it, within the window."""
        held = self.slot_of[:used].view(1, 1, -1)
        query = query_slots.view(1, -1, 1)
        allowed = (held >= 0) & (held <= query)
        if self.window:
            allowed = allowed & (held > query - self.window)
        own_row = held >= self.cache.pad.view(-1, 1, 1)
        return (allowed & own_row).unsqueeze(1)
