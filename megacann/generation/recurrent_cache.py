"""The cache of a Gated DeltaNet layer while generating: per row the recurrent state ``[heads, dk, dv]``
(fp32) and the short convolution's last ``kernel - 1`` inputs, a fixed size whatever the length.

The prefill runs the chunked rule over the left-padded prompts with each row's padding kept out
(:meth:`~megacann.layers.GatedDeltaNet.cached_rule`: the convolution and the state start at the row's first
real token) and keeps the state and the convolution's tail of every row; each later step advances them by
one token. Under tensor parallelism each rank keeps its own heads' share (``local_value_heads``, its
channels of the convolution).
"""

from __future__ import annotations

from typing import Optional

import torch

from megacann.generation.kv_cache import KVCache, register_cache_layer
from megacann.layers import GatedDeltaNet
from megacann.layers.gated_deltanet import GatedDeltaNetCache
from megacann.models.decode_cache import RecurrentState


def recurrent_cache_bytes(
    num_layers: int,
    batch: int,
    value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    conv_channels: int,
    conv_kernel: int,
    dtype: torch.dtype,
) -> int:
    """Bytes of the caches of ``num_layers`` Gated DeltaNet layers for ``batch`` rows: the fp32 state
    ``value_heads · key_head_dim · value_head_dim`` and ``conv_kernel - 1`` inputs of ``conv_channels``
    in ``dtype`` a row (``value_heads`` and ``conv_channels``: those one rank holds); no term in the length
    (:class:`~megacann.models.decode_cache.RecurrentState`'s formula, which the planners use too)."""
    kind = RecurrentState(value_heads, key_head_dim, value_head_dim, conv_channels, conv_kernel)
    return num_layers * kind.nbytes(batch, 0, dtype)


class RecurrentCacheLayer:
    """One :class:`GatedDeltaNet`'s rows of a :class:`KVCache`: ``state`` (a :class:`GatedDeltaNetCache`,
    made by the prefill, when the layer's weights are at hand). A forward of several tokens after cached
    ones (``extendable``) runs them from the state and the convolution's inputs after the last token fed."""

    extendable = True

    def __init__(self, cache: KVCache, attention: GatedDeltaNet, batch: int):
        self.cache, self.batch = cache, batch
        self.state: Optional[GatedDeltaNetCache] = None

    @property
    def nbytes(self) -> int:
        if self.state is None:
            return 0
        return self.state.conv_state.nbytes + self.state.recurrent_state.nbytes

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.batch = len(rows)
        if self.state is not None:
            self.state.conv_state = self.state.conv_state.index_select(0, rows)
            self.state.recurrent_state = self.state.recurrent_state.index_select(0, rows)

    def mix(self, attention: GatedDeltaNet, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The delta rule's output for this forward's tokens (the prefill's prompts, or one new token a
        row), from and into each row's state."""
        real = None
        if self.cache.length == 0:
            self.state = attention.new_cache(self.batch)
            columns = torch.arange(mixed.shape[1], device=mixed.device)
            real = columns.unsqueeze(0) >= self.cache.pad.unsqueeze(1)
        return attention.cached_rule(mixed, b, a, self.state, real)


register_cache_layer(GatedDeltaNet, RecurrentCacheLayer)
