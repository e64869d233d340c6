"""ZeRO's gradient buffer: buckets reduce-scattered, each rank keeping the sum over its own range.

ZeRO-1 (``keep_full=True``) keeps the full fp32 buffer: the reduce-scatter runs in place, so this rank's
range of each bucket holds the summed gradient and the rest its local, unreduced one. ZeRO-2
(``keep_full=False``) keeps only a persistent shard of ``numel / N`` elements; a bucket's full storage
is allocated at its first gradient of a step, kept while micro-batches accumulate into it (gradient
accumulation sums locally, one reduction per step), and freed as soon as its reduce-scatter has
finished: during backward with ``overlap_grad_reduce``, else right after it. Under hybrid sharding
(``replica_groups``) each reduced range is then summed over the shard groups.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megacann.collectives import reduce_scatter_flat
from megacann.layers.sharding import get_sharding
from megacann.optimizer.grad_buffer import Bucket, GradBuffer
from megacann.optimizer.zero.layout import owned_range, shard_slice


class ShardedGradBuffer(GradBuffer):
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group: Optional[dist.ProcessGroup],
        bucket_size: int = 40_000_000,
        pad_to: int = 1,
        device: Optional[torch.device] = None,
        own_bucket=None,
        keep_full: bool = True,
        unit_of=None,
        replica_groups: Optional[dict[bool, Optional[dist.ProcessGroup]]] = None,
    ):
        super().__init__(params, group, bucket_size, pad_to, device, own_bucket, keep_full, unit_of)
        # hybrid sharding: the ranks holding the same ranges in the other shard groups (summed over after)
        expert = bool(params) and get_sharding(params[0]).expert
        self.replica_group = (replica_groups or {}).get(expert)
        self.rank = dist.get_rank(group) if self.group_size > 1 else 0
        self.shard_numel = self.numel // self.group_size
        # ZeRO-2: the reduced gradients of this rank's ranges, the only gradient storage kept between steps
        # (never zeroed: each bucket's reduction writes its whole slice of it)
        self.shard = None if keep_full else torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)

    def owned_grad(self, bucket: Bucket) -> torch.Tensor:
        """This rank's range of ``bucket``: after the reduction, the summed gradients."""
        if self.shard is not None:
            return self.shard[shard_slice(bucket, self.group_size)]
        start, end = owned_range(bucket, self.rank, self.group_size)
        return self.data[start:end]

    def _start_reduction(self, bucket: Bucket) -> Optional[dist.Work]:
        out = self.owned_grad(bucket)
        if self.group_size == 1:
            if self.shard is not None:
                out.copy_(bucket.data)
            return None
        return reduce_scatter_flat(out, bucket.data, self.group, async_op=True)

    def _after_reduction(self, bucket: Bucket) -> None:
        if self.replica_group is not None:
            dist.all_reduce(self.owned_grad(bucket), group=self.replica_group)
        self.release(bucket)

    def reduced_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The part of ``param``'s summed gradient this rank owns, flattened (empty when it owns none)."""
        bucket = self.bucket_of[id(param)]
        own_start, own_end = owned_range(bucket, self.rank, self.group_size)
        start, end = self.ranges[id(param)]
        lo = min(max(start, own_start), own_end)
        hi = max(min(end, own_end), lo)
        return self.owned_grad(bucket)[lo - own_start : hi - own_start]

    def update_grads(self) -> list[torch.Tensor]:
        if self.shard is not None:
            return [self.shard]
        return [self.owned_grad(bucket) for bucket in self.buckets]
