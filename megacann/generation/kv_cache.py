"""The cache of a generation: per attention layer, what the layer keeps of each earlier token, preallocated
for ``batch`` rows of ``max_len`` tokens, with shared bookkeeping for all layers; and the attention of a
:class:`~megacann.layers.SelfAttention` over its cached keys and values.

Rows are left-padded to a common length, so every row writes its token of a step into the same slot;
``pad[row]`` says where its real tokens begin, and no query ever reads a slot before it. The first
forward (the prefill) attends with the training attention (``segment_ids``: padding 0, prompt 1, so no
``[s, s]`` mask on CPU); later ones attend over the cache with a ``[b, 1, s, slots]`` mask. A layer with a
sliding window W keeps a rolling cache of ``min(W, max_len)`` slots: a token at slot ``t`` lives at
``t mod W`` and overwrites the one that left the window; a forward of several tokens after cached ones (a
chat's next turn) reads the window as held before it, then its own tokens. Under tensor parallelism each
rank caches the kv heads its query heads read (``SelfAttention.local_kv_heads``): the cache is sharded by
heads.

Which layers a cache serves, and how, is declared per attention class (:func:`register_cache_layer`):
``SelfAttention`` caches keys and values (:class:`KVCacheLayer`), latent attention its compressed latent
(:mod:`megacann.generation.latent_cache`); a custom attention registers its own. A layer's tensors are
allocated when the prefill first writes them, so a layer that never runs while generating (a
multi-token-prediction depth) holds nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch

from megacann import ops
from megacann.layers import SelfAttention
from megacann.models.decode_cache import KeysValues


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
    (``kv_heads``: those one rank holds); a sliding window W keeps ``min(W, max_len)`` tokens a row
    (:class:`~megacann.models.decode_cache.KeysValues`' formula, which the planners use too)."""
    return num_layers * KeysValues(kv_heads, head_dim, window=sliding_window).nbytes(batch, max_len, dtype)


_CACHE_LAYERS: list[tuple[type, type]] = []  # (attention class, the cache layer class serving it)


def register_cache_layer(attention_class: type, cache_layer_class: type) -> None:
    """Instances of ``attention_class`` (a module with a ``kv_cache`` attribute that its forward reads
    while generating) get a ``cache_layer_class(cache, attention, batch)`` each from :class:`KVCache`."""
    _CACHE_LAYERS.insert(0, (attention_class, cache_layer_class))  # the latest registration wins


def cache_layer_class(module: torch.nn.Module) -> Optional[type]:
    """The cache layer class registered for ``module``'s class (None: no attention a cache serves)."""
    return next((layer for kind, layer in _CACHE_LAYERS if isinstance(module, kind)), None)


class KVCache:
    """The caches of every attention layer of ``model`` (those of a class with a registered cache layer)
    for ``batch`` rows of at most ``max_len`` tokens (prompt, padding and new tokens). ``pad``
    ``[batch]``: each row's padding. :meth:`attached` sets them on the layers for the forwards of a
    generation; :meth:`advance` moves past the tokens a forward wrote; :meth:`keep_rows` drops finished
    rows."""

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, pad: torch.Tensor):
        served = [(m, cache_layer_class(m)) for m in model.modules()]
        served = [(m, layer) for m, layer in served if layer is not None]
        if not served:
            known = ", ".join(kind.__name__ for kind, _ in _CACHE_LAYERS)
            raise ValueError(f"the model has no attention layer a cache serves (registered: {known})")
        self.max_len, self.length, self.pad = max_len, 0, pad
        # masks of this forward (cleared by advance), shared by the layers of one kind: every layer writes
        # the same positions
        self.masks: dict[tuple, torch.Tensor] = {}
        self.attentions = [m for m, _ in served]
        self.layers = [layer(self, m, batch) for m, layer in served]

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (every layer's tensors on this rank)."""
        return sum(layer.nbytes for layer in self.layers)

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

    @property
    def extendable(self) -> bool:
        """Whether a forward of several tokens may follow cached ones (:meth:`Generator.extend`): every
        layer's class says so (``extendable``; a registered cache layer without it is not)."""
        return all(getattr(layer, "extendable", False) for layer in self.layers)

    def advance(self, tokens: int) -> None:
        """The last forward wrote ``tokens`` slots of every row."""
        self.length += tokens
        self.masks.clear()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current batch): finished requests cost nothing more."""
        self.pad = self.pad.index_select(0, rows)
        for layer in self.layers:
            layer.keep_rows(rows)


class CacheLayer:
    """One layer's share of a :class:`KVCache`: ``entries``, tensors of ``[batch, slots, ...]`` (what the
    layer keeps of a token), and the slot each cache position holds (``slot_of``, -1: empty). ``window``
    W (None: none) makes it a rolling cache of ``min(W, max_len)`` positions. Subclasses add ``attend``.
    A forward of several tokens may follow cached ones (``extendable``): a rolling cache's queries then
    read what it held before the forward beside the new tokens (:meth:`store_and_read`)."""

    extendable = True

    def __init__(self, cache: KVCache, batch: int, window: Optional[int]):
        self.cache, self.window, self.batch = cache, window, batch
        self.slots = min(cache.max_len, window) if window else cache.max_len
        self.entries: list[torch.Tensor] = []  # allocated by the first store
        self.slot_of: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    @property
    def rolling(self) -> bool:
        return self.slots < self.cache.max_len

    def store(self, *new: torch.Tensor) -> None:
        """Write this forward's ``[b, s, ...]`` tensors (one per entry) at the next ``s`` positions."""
        if not self.entries:
            self.entries = [x.new_zeros((self.batch, self.slots, *x.shape[2:])) for x in new]
            self.slot_of = torch.full((self.slots,), -1, dtype=torch.long, device=new[0].device)
        start, s = self.cache.length, new[0].shape[1]
        if start + s > self.cache.max_len:
            raise ValueError(f"the key/value cache holds {self.cache.max_len} tokens a row; {start + s} asked")
        keep = min(s, self.slots)  # a rolling cache keeps the last W of a long prompt
        first = (start + s - keep) % self.slots
        if first + keep <= self.slots:  # the slots lie in one run: copied in place (a decode step's one slot)
            for entry, x in zip(self.entries, new):
                entry[:, first : first + keep].copy_(x[:, s - keep :])
            if keep == 1:
                self.slot_of[first] = start + s - 1
            else:
                self.slot_of[first : first + keep] = torch.arange(start + s - keep, start + s, device=new[0].device)
            return
        positions = torch.arange(start + s - keep, start + s, device=new[0].device)
        where = positions % self.slots
        for entry, x in zip(self.entries, new):
            entry[:, where] = x[:, s - keep :].to(entry.dtype)
        self.slot_of[where] = positions

    def store_and_read(self, *new: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Store this forward's tensors (after cached ones); what its ``s`` queries read, each entry
        ``[b, t, ...]``, and the mask ``[b, 1, s, t]``. A rolling cache's forward of several tokens would
        overwrite entries its first queries still read: they read the slots as held before it, then the
        new tokens (``t = slots + s``), the window's positions going on from the cached ones."""
        s = new[0].shape[1]
        if not (self.rolling and s > 1):
            self.store(*new)
            used = self.used(s)
            return [entry[:, :used] for entry in self.entries], self.mask(s, used)
        start = self.cache.length
        held = torch.cat([self.slot_of, torch.arange(start, start + s, device=self.slot_of.device)])
        read = [torch.cat([entry, x.to(entry.dtype)], 1) for entry, x in zip(self.entries, new)]
        key = ("held then new", s, self.slots, self.window)
        if key not in self.cache.masks:
            self.cache.masks[key] = self._build_mask(s, held)
        self.store(*new)
        return read, self.cache.masks[key]

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.batch = len(rows)
        self.entries = [entry.index_select(0, rows) for entry in self.entries]

    def used(self, s: int) -> int:
        """Slots a query of this forward (``s`` new tokens, stored) may read: a full cache's empty tail
        is not read."""
        return self.slots if self.rolling else self.cache.length + s

    def padding_segments(self, s: int, device: torch.device) -> torch.Tensor:
        """The prefill's ``segment_ids`` ``[b, s]``: padding 0, the prompt 1 (never attended across)."""
        columns = torch.arange(s, device=device)
        return (columns.unsqueeze(0) >= self.cache.pad.unsqueeze(1)).long()

    def mask(self, s: int, used: int) -> torch.Tensor:
        """``[b, 1, s, used]``, True where one of this forward's ``s`` queries may read a cached entry: one
        of its own row (not padding), not after it, within the window. Built once a forward for all the
        layers of the same slots and window."""
        key = (s, used, self.slots, self.window)
        if key not in self.cache.masks:
            self.cache.masks[key] = self._build_mask(s, self.slot_of[:used])
        return self.cache.masks[key]

    def _build_mask(self, s: int, held: torch.Tensor) -> torch.Tensor:
        """The mask of :meth:`mask` over the entries of the positions ``held`` (-1: empty)."""
        start = self.cache.length
        held = held.view(1, 1, -1)
        query = torch.arange(start, start + s, device=held.device).view(1, -1, 1)
        allowed = (held >= 0) & (held <= query)
        if self.window:
            allowed = allowed & (held > query - self.window)
        own_row = held >= self.cache.pad.view(-1, 1, 1)
        return (allowed & own_row).unsqueeze(1)


class KVCacheLayer(CacheLayer):
    """One :class:`SelfAttention`'s keys and values, ``[batch, slots, local_kv_heads, head_dim]`` each."""

    def __init__(self, cache: KVCache, attention: SelfAttention, batch: int):
        super().__init__(cache, batch, attention.sliding_window)

    @property
    def keys(self) -> Optional[torch.Tensor]:
        return self.entries[0] if self.entries else None

    @property
    def values(self) -> Optional[torch.Tensor]:
        return self.entries[1] if self.entries else None

    def attend(self, attention: SelfAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's keys and values, then attend: the prefill over itself (the training kernels,
        padding as its own segment), a later forward over the cache (with the layer's sinks, if any)."""
        if self.cache.length == 0:  # whole sequences: never across context-parallel ranks
            self.store(k, v)
            segments = self.padding_segments(q.shape[1], q.device)
            return attention.core_attention(q, *attention.expand_kv(k, v), segments, whole_sequence=True)
        (keys, values), mask = self.store_and_read(k, v)
        keys, values = attention.expand_kv(keys, values)
        return ops.decode_attention(
            q, keys, values, attn_mask=mask, scale=attention.softmax_scale, sinks=attention.sinks
        )


register_cache_layer(SelfAttention, KVCacheLayer)
