"""Contiguous fp32 gradient buffers, split in buckets, reduced over the data-parallel group.

Every trainable parameter gets ``param.main_grad``, a view into one flat fp32 buffer, where its gradient
accumulates over micro-batches whatever the parameter's own dtype (fp32 parameters use the view as their
``.grad`` directly; low-precision ones add into it from a post-accumulate hook). Buckets are contiguous
ranges of that buffer reduced with one collective each; ZeRO replaces the all-reduce by a
reduce-scatter over the same buckets, which is why each bucket is padded to a multiple of the
data-parallel size. Expert-parallel parameters live in their own buffer, reduced over the
expert-data-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.layers.sharding import get_sharding


@dataclass
class Bucket:
    """A contiguous range [start, end) of a buffer and the parameters whose gradients lie in it."""

    params: list[torch.nn.Parameter]
    start: int
    end: int
    index: int
    pending: set = field(default_factory=set)  # ids of params whose gradient is not final yet (overlap)
    handle: Optional[object] = None  # async collective in flight


class GradBuffer:
    """Flat fp32 storage for the gradients of ``params``, reduced over ``group``."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group: Optional[dist.ProcessGroup],
        bucket_size: int = 40_000_000,
        pad_to: int = 1,
        device: Optional[torch.device] = None,
    ):
        self.group = group
        self.group_size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        self.params = list(params)
        device = device or (self.params[0].device if self.params else torch.device("cpu"))
        # Parameters are laid out in reverse order: backward produces the last layers' gradients first.
        self.ranges: dict[int, tuple[int, int]] = {}
        self.buckets: list[Bucket] = []
        offset, bucket_params, bucket_start = 0, [], 0

        def close_bucket() -> None:
            nonlocal offset, bucket_params, bucket_start
            offset = _round_up(offset, pad_to)
            self.buckets.append(Bucket(bucket_params, bucket_start, offset, len(self.buckets)))
            bucket_params, bucket_start = [], offset

        for p in reversed(self.params):
            n = p.numel()
            self.ranges[id(p)] = (offset, offset + n)
            offset += n
            bucket_params.append(p)
            if offset - bucket_start >= bucket_size:
                close_bucket()
        if bucket_params:
            close_bucket()
        self.numel = offset
        self.data = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.bucket_of: dict[int, Bucket] = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self.bucket_of[id(p)] = bucket
        for p in self.params:
            start, end = self.ranges[id(p)]
            p.main_grad = self.data[start:end].view(p.shape)

    def zero(self) -> None:
        self.data.zero_()

    def all_reduce(self) -> None:
        """Sum every bucket over the group (the loss is already normalised by the global token count)."""
        if self.group_size == 1:
            return
        for bucket in self.buckets:
            dist.all_reduce(self.data[bucket.start : bucket.end], group=self.group)


def _round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


def _accumulate_into_main_grad(param: torch.nn.Parameter) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


class GradBuffers:
    """The gradient buffers of a model: one for dense parameters (DP group), one for experts (expert-DP)."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_size: int = 40_000_000, pad_for_zero: bool = False):
        trainable = [p for p in params if p.requires_grad]
        dense = [p for p in trainable if not get_sharding(p).expert]
        expert = [p for p in trainable if get_sharding(p).expert]
        self.buffers: list[GradBuffer] = []
        for members, group, size in (
            (dense, ps.get_data_parallel_group(), ps.get_data_parallel_world_size()),
            (expert, ps.get_expert_data_parallel_group(), ps.get_expert_data_parallel_world_size()),
        ):
            if members:
                self.buffers.append(GradBuffer(members, group, bucket_size, pad_to=size if pad_for_zero else 1))
        self._hooks = []
        for p in trainable:
            if p.dtype == torch.float32:
                p.grad = p.main_grad  # autograd accumulates in place into the buffer view
            else:
                self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_into_main_grad))

    def zero(self) -> None:
        for buffer in self.buffers:
            buffer.zero()

    def all_reduce(self) -> None:
        for buffer in self.buffers:
            buffer.all_reduce()

    def check_for_inf_or_nan(self) -> bool:
        """True when any gradient on any rank is not finite (agreed across the whole world)."""
        found = torch.zeros(1)
        for buffer in self.buffers:
            if not torch.isfinite(buffer.data).all():
                found.fill_(1.0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            found = found.to(self.buffers[0].data.device) if self.buffers else found
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item() > 0)

    def scale_(self, factor: float) -> None:
        for buffer in self.buffers:
            buffer.data.mul_(factor)
