"""ZeRO-3's parameter storage: each rank keeps only its ranges of the weights; a bucket's whole weights
exist only while gathered.

The layout is the gradient buffer's (``GradBuffer``: buckets padded to a multiple of the group size N,
rank r owning the r-th of N equal ranges of each bucket), so the weight shard, the fp32 master shard and
the optimizer state line up element for element. Every parameter's ``.data`` is a view of its bucket's
full tensor, whose *storage* is resized to nothing when the bucket is freed and back when it is gathered:
tensors autograd saved in the forward point at that storage too, so they see the weights again once the
bucket is gathered for the backward (the way FSDP frees its flat parameters).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megacann.collectives import all_gather_flat
from megacann.ops.weight_grad import mark_released_after_backward
from megacann.optimizer.grad_buffer import Bucket, GradBuffer
from megacann.optimizer.zero.layout import owned_range, shard_slice

FREE, GATHERING, READY = 0, 1, 2


def _free_storage(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _alloc_storage(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


class ShardedParams:
    """The parameters of ``layout`` (a gradient buffer, or a gradient-less one for frozen weights) stored as
    this rank's shard (``shard``: ``numel / N`` elements of the parameters' dtype) plus, per bucket, a full
    tensor allocated only while gathered. ``gather_bucket`` / ``wait_bucket`` / ``free_bucket`` drive it."""

    def __init__(self, layout: GradBuffer, rank: int):
        self.layout = layout
        self.rank, self.size = rank, layout.group_size
        self.group = layout.group
        dtypes = {p.dtype for p in layout.params}
        if len(dtypes) > 1:
            raise ValueError(f"a parameter buffer holds one dtype, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop() if dtypes else torch.float32
        self.dtype = dtype
        self.shard = torch.zeros(layout.numel // self.size, dtype=dtype, device=layout.device)
        self.full: list[torch.Tensor] = []
        self.status: list[int] = []
        self.handles: dict[int, Optional[dist.Work]] = {}
        with torch.no_grad():
            for bucket in layout.buckets:
                full = torch.zeros(bucket.numel, dtype=dtype, device=layout.device)
                for p in bucket.params:
                    start, end = layout.ranges[id(p)]
                    view = full[start - bucket.start : end - bucket.start].view(p.shape)
                    view.copy_(p.detach())
                    p.data = view  # the model reads the bucket's full tensor, allocated only when gathered
                    mark_released_after_backward(p)  # freed before a split backward's W (megacann.ops.weight_grad)
                self.shard[shard_slice(bucket, self.size)].copy_(self._owned_of_full(bucket, full))
                _free_storage(full)
                self.full.append(full)
                self.status.append(FREE)

    def _owned_of_full(self, bucket: Bucket, full: torch.Tensor) -> torch.Tensor:
        start, end = owned_range(bucket, self.rank, self.size)
        return full[start - bucket.start : end - bucket.start]

    # -- the optimizer's side -------------------------------------------------------------------------
    def owned(self, bucket: Bucket) -> torch.Tensor:
        """This rank's range of ``bucket`` (what its optimizer updates): a slice of the shard."""
        return self.shard[shard_slice(bucket, self.size)]

    def master_view(self, buffer_start: int, shard_start: int, numel: int) -> torch.Tensor:
        """fp32 weights are their own masters: the shard's elements."""
        return self.shard[shard_start : shard_start + numel]

    def gather(self, async_op: bool) -> None:
        """After an update: every gathered bucket is stale, so all are freed (units gather when they run)."""
        self.free_all()

    def wait(self, params=None) -> None:
        """Gather every bucket and keep it (code that reads weights outside a forward: checkpoints, export);
        the next forward frees each unit after it ran."""
        for bucket in self.layout.buckets:
            self.gather_bucket(bucket.index)
        for bucket in self.layout.buckets:
            self.wait_bucket(bucket.index)

    @torch.no_grad()
    def absorb_gathered(self) -> None:
        """Copy this rank's ranges of the gathered buckets into the shard (weights loaded in place)."""
        for bucket in self.layout.buckets:
            if self.status[bucket.index] != FREE:
                self.wait_bucket(bucket.index)
                self.owned(bucket).copy_(self._owned_of_full(bucket, self.full[bucket.index]))

    # -- gathering ------------------------------------------------------------------------------------
    @torch.no_grad()
    def gather_bucket(self, index: int) -> None:
        """Start gathering bucket ``index`` (asynchronously where the backend can); no-op unless free."""
        if self.status[index] != FREE:
            return
        bucket, full = self.layout.buckets[index], self.full[index]
        _alloc_storage(full)
        own = self.owned(bucket)
        if self.size == 1:
            full.copy_(own)
            handle = None
        else:
            handle = all_gather_flat(full, own, self.group, async_op=True)
        self.handles[index] = handle
        self.status[index] = GATHERING

    def wait_bucket(self, index: int) -> None:
        if self.status[index] == GATHERING:
            handle = self.handles.pop(index, None)
            if handle is not None:
                handle.wait()
            self.status[index] = READY

    def free_bucket(self, index: int) -> None:
        if self.status[index] == FREE:
            return
        self.wait_bucket(index)  # a collective still writing into it must land first
        _free_storage(self.full[index])
        self.status[index] = FREE

    def free_all(self) -> None:
        for bucket in self.layout.buckets:
            self.free_bucket(bucket.index)

    def is_free(self, index: int) -> bool:
        """Whether bucket ``index`` is neither gathered nor being gathered."""
        return self.status[index] == FREE

    def gathered_numel(self) -> int:
        """Elements of full weights held now (gathered or being gathered)."""
        return sum(b.numel for b in self.layout.buckets if self.status[b.index] != FREE)
