"""What each layer of a model keeps while generating (its decode cache layout), declared by the family
through ``ModelSpec.decode_cache`` and read by the generation cache's byte formulas and by the planners.

A layout is one entry per layer, of one of four kinds, sized for the whole model (all tensor-parallel
ranks together); :meth:`for_rank` gives the largest share one rank of ``tp`` holds, :meth:`nbytes` the
bytes of a layer for ``batch`` rows of ``slots`` tokens. These are the only byte formulas of a cache:
:func:`megacann.generation.kv_cache_bytes`, ``latent_cache_bytes``, ``recurrent_cache_bytes`` and
``compressed_cache_bytes`` are them, and ``--dry_run`` / ``megacann-plan`` sum them over a family's layout.

- :class:`KeysValues`: each token's keys and values, ``[batch, slots, kv_heads, head_dim]`` each; a
  sliding window W keeps ``min(W, slots)`` slots. A rank caches the kv heads its query heads read.
- :class:`CompressedLatent`: latent attention's normed latent and shared rotary key, ``kv_lora_rank +
  rope_head_dim`` values a token, plus a sparse indexer's key (``index_head_dim``) when there is one;
  whole on every rank.
- :class:`RecurrentState`: a linear-attention layer's fp32 state ``[value_heads, key_head_dim,
  value_head_dim]`` and its convolution's last ``conv_kernel - 1`` inputs a row, whatever the length;
  split by heads over tensor-parallel ranks.
- :class:`CompressedWindow`: DeepSeek-V4's compressed attention: a rolling window of each token's rotated
  KV head (``head_dim``), and on its compressed layers each token's compressor projections (and its
  indexer's) for every slot; whole on every rank.

A family that declares nothing and can decode gets :func:`attention_cache_layout`: keys and values of the
common keys (``kv_heads``, the head width, ``num_attention_heads``) in every layer, no window.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

import torch

from megacann.config import ModelConfig
from megacann.layers.attention import kv_heads_for_rank
from megacann.models.sizing import attention_head_dim


@dataclass(frozen=True)
class KeysValues:
    """Keys and values of ``kv_heads`` heads of width ``head_dim``, read by ``query_heads`` query heads
    (None: as many as kv heads); ``window``: a sliding window's length (None: every token is kept)."""

    kv_heads: int
    head_dim: int
    query_heads: Optional[int] = None
    window: Optional[int] = None

    def for_rank(self, tp: int) -> KeysValues:
        """The kv heads of the rank of ``tp`` that reads the most: ``kv / tp`` when tp divides them, else
        the heads its query heads read (:func:`~megacann.layers.attention.kv_heads_for_rank`)."""
        queries = self.query_heads or self.kv_heads
        if self.kv_heads % tp == 0:
            heads = self.kv_heads // tp
        else:
            ranges = (kv_heads_for_rank(queries, self.kv_heads, tp, rank) for rank in range(tp))
            heads = max(end - first for first, end in ranges)
        return replace(self, kv_heads=heads, query_heads=queries // tp)

    def nbytes(self, batch: int, slots: int, dtype: torch.dtype) -> int:
        kept = min(slots, self.window) if self.window else slots
        return 2 * batch * kept * self.kv_heads * self.head_dim * dtype.itemsize

    def describe(self) -> str:
        window = f", window {self.window}" if self.window else ""
        return f"keys and values of {self.kv_heads} kv heads x head dim {self.head_dim}{window}"


@dataclass(frozen=True)
class CompressedLatent:
    """Latent attention's cache: the normed latent (``kv_lora_rank``) and the rotary key shared by the
    heads (``rope_head_dim``) of each token, and a sparse indexer's key (``index_head_dim``; 0: none)."""

    kv_lora_rank: int
    rope_head_dim: int
    index_head_dim: int = 0

    def for_rank(self, tp: int) -> CompressedLatent:
        """The latent serves every head: each rank caches all of it."""
        return self

    def nbytes(self, batch: int, slots: int, dtype: torch.dtype) -> int:
        return batch * slots * (self.kv_lora_rank + self.rope_head_dim + self.index_head_dim) * dtype.itemsize

    def describe(self) -> str:
        index = f" + index key {self.index_head_dim}" if self.index_head_dim else ""
        return f"latent {self.kv_lora_rank} + rotary key {self.rope_head_dim}{index} a token"


@dataclass(frozen=True)
class RecurrentState:
    """A linear-attention layer's cache (Gated DeltaNet): the fp32 state of ``value_heads`` heads of
    ``key_head_dim x value_head_dim`` and the last ``conv_kernel - 1`` inputs of its ``conv_channels``
    convolution channels, a row; no term in the length."""

    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_channels: int
    conv_kernel: int

    def for_rank(self, tp: int) -> RecurrentState:
        """Heads (and with them the convolution's channels) split evenly over ``tp`` ranks."""
        return replace(self, value_heads=self.value_heads // tp, conv_channels=self.conv_channels // tp)

    def nbytes(self, batch: int, slots: int, dtype: torch.dtype) -> int:
        state = self.value_heads * self.key_head_dim * self.value_head_dim * torch.float32.itemsize  # fp32 always
        conv_tail = (self.conv_kernel - 1) * self.conv_channels * dtype.itemsize
        return batch * (state + conv_tail)

    def describe(self) -> str:
        return (
            f"Gated DeltaNet states of {self.value_heads} heads x {self.key_head_dim} x {self.value_head_dim} (fp32) "
            f"and {self.conv_kernel - 1} inputs of {self.conv_channels} channels a row"
        )


@dataclass(frozen=True)
class CompressedWindow:
    """DeepSeek-V4's attention cache: the single KV head (``head_dim`` values) of the last ``window`` tokens,
    and ``projection_width`` values a token of compressor projections for every slot (0 on sliding layers;
    the compressed entries are pooled again from them at each step)."""

    head_dim: int
    window: int
    projection_width: int = 0

    def for_rank(self, tp: int) -> CompressedWindow:
        """One KV head serves every query head: each rank caches all of it and all the projections."""
        return self

    def nbytes(self, batch: int, slots: int, dtype: torch.dtype) -> int:
        local = min(self.window, slots) * self.head_dim
        return batch * (local + slots * self.projection_width) * dtype.itemsize

    def describe(self) -> str:
        history = f" + compressor projections {self.projection_width} a token" if self.projection_width else ""
        return f"a KV head of {self.head_dim}, window {self.window}{history}"


LayerCache = Union[KeysValues, CompressedLatent, RecurrentState, CompressedWindow]


def attention_cache_layout(cfg: ModelConfig) -> list[LayerCache]:
    """The default layout: every layer caches keys and values of the common keys, no window."""
    kinds = KeysValues(cfg.kv_heads, attention_head_dim(cfg), cfg.num_attention_heads)
    return [kinds] * cfg.num_layers


def cache_bytes(layout: list[LayerCache], tp: int, batch: int, slots: int, dtype: torch.dtype) -> int:
    """Bytes one rank of ``tp`` holds of ``layout``'s layers for ``batch`` rows of ``slots`` tokens."""
    return sum(kind.for_rank(tp).nbytes(batch, slots, dtype) for kind in layout)
