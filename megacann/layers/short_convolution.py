"""The short causal depthwise convolution of linear-attention blocks (Gated DeltaNet's ``conv1d``).

Each channel is convolved with its own kernel of ``kernel_size`` taps over the current and the previous
``kernel_size - 1`` tokens, then passed through SiLU. Written as ``kernel_size`` shifted products rather
than ``F.conv1d`` so that packed documents are exact: a tap that reaches into an earlier document is
multiplied by zero, so each document sees only its own tokens, as if run alone. The tokens before the
first are zeros, or ``left`` (the previous tokens' inputs: a decoding cache, or the chunk before under
context parallelism).

The weight is ``[channels, 1, kernel_size]`` (``nn.Conv1d``'s depthwise layout, as Hugging Face stores it).
Its channels follow the fused projection that feeds it, so under tensor parallelism it is split with the
same ``tp_blocks`` and each rank convolves its own heads' channels.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megacann.layers import mappings
from megacann.layers.init import make_parameter
from megacann.layers.sharding import InitMethod


class ShortConvolution(torch.nn.Module):
    """``forward(x [b, s, channels], segment_ids=None, left=None, left_segments=None) -> [b, s, channels]``:
    ``silu(causal depthwise conv(x))``; ``segment_ids`` ``[b, s]`` keep the taps inside each document,
    ``left`` ``[b, kernel_size - 1, channels]`` (and its ``left_segments``) are the inputs before ``x``."""

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        init_method: InitMethod,
        tp_blocks: Optional[tuple[int, ...]] = None,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"ShortConvolution: kernel_size must be at least 1, got {kernel_size}")
        self.kernel_size = kernel_size
        self.weight = make_parameter(
            (channels, 1, kernel_size),
            init_method,
            tp_rank=mappings.tp_rank(group),
            tp_size=mappings.tp_world_size(group),
            tp_dim=0,
            tp_blocks=tp_blocks,
            name=f"ShortConvolution channels {channels}",
            dtype=dtype,
            device=device,
        )

    @property
    def context(self) -> int:
        """How many earlier tokens each output reads: ``kernel_size - 1``."""
        return self.kernel_size - 1

    def extra_repr(self) -> str:
        return f"channels={self.weight.shape[0]}, kernel_size={self.kernel_size}"

    def forward(
        self,
        x: torch.Tensor,
        segment_ids: Optional[torch.Tensor] = None,
        left: Optional[torch.Tensor] = None,
        left_segments: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        b, s, channels = x.shape
        if left is None:
            left = x.new_zeros((b, self.context, channels))
        padded = torch.cat([left.to(x.dtype), x], dim=1)
        if segment_ids is not None:
            if left_segments is None:  # the zeros before the sequence: any id will do
                left_segments = segment_ids[:, :1].expand(b, self.context)
            padded_ids = torch.cat([left_segments, segment_ids], dim=1)
        weight = self.weight[:, 0].to(x.dtype)  # [channels, kernel]
        out = None
        for tap in range(self.kernel_size):  # tap kernel_size-1 reads the token itself, tap 0 the oldest
            term = padded[:, tap : tap + s] * weight[:, tap]
            if segment_ids is not None:
                term = term * (padded_ids[:, tap : tap + s] == segment_ids).unsqueeze(-1).to(x.dtype)
            out = term if out is None else out + term
        return F.silu(out)

    def last_inputs(self, x: torch.Tensor, left: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The last ``kernel_size - 1`` inputs of ``left`` followed by ``x`` (zeros before the first): what a
        decoding cache keeps for the next token."""
        if left is None:
            left = x.new_zeros((x.shape[0], self.context, x.shape[2]))
        return torch.cat([left.to(x.dtype), x], dim=1)[:, x.shape[1] :]
