"""Which data-parallel rank owns which elements of which parameter under ZeRO.

A gradient buffer (``GradBuffer``) lays its parameters out back to back in buckets; under ZeRO each
bucket is padded to a multiple of the data-parallel size N and split into N equal, contiguous ranges:
rank r owns ``[start + r*L, start + (r+1)*L)`` with ``L = bucket size / N``. Everything a rank keeps of
the optimizer (fp32 master weights, Adam moments, reduced gradients under ZeRO-2) is the concatenation
of its ranges over the buckets, its *shard* (``buffer.numel / N`` elements, padding included).

A :class:`ShardRange` is one parameter's part of one rank's shard, addressed both ways: by elements
``[param_start, param_end)`` of the parameter's flattened local tensor-parallel shard (layout-free, what
``StateShard`` and checkpoints use) and by position in the buffer and in the rank's shard. The layout
depends only on the parameters and sizes, so any rank can compute any other rank's ranges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class BucketLike(Protocol):
    params: list[torch.nn.Parameter]
    start: int
    end: int
    index: int


class BufferLike(Protocol):
    buckets: list[Any]  # BucketLike
    ranges: dict[int, tuple[int, int]]


@dataclass(frozen=True)
class ShardRange:
    """Elements [param_start, param_end) of one parameter (flattened local TP shard) owned by one rank."""

    name: str
    param: torch.nn.Parameter
    bucket: int  # bucket index in its buffer
    param_start: int
    param_end: int
    buffer_start: int  # where param_start lies in the buffer
    shard_start: int  # where param_start lies in the owning rank's shard

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start

    def describe(self) -> dict[str, Any]:
        """Plain-data form (for checkpoint metadata): no tensors."""
        return {
            "name": self.name,
            "shape": tuple(self.param.shape),
            "bucket": self.bucket,
            "param_start": self.param_start,
            "param_end": self.param_end,
            "buffer_start": self.buffer_start,
            "shard_start": self.shard_start,
        }


def owned_range(bucket: BucketLike, rank: int, size: int) -> tuple[int, int]:
    """Buffer positions [start, end) of ``bucket`` owned by data-parallel ``rank`` of ``size``."""
    numel = bucket.end - bucket.start
    if numel % size or bucket.start % size:
        raise ValueError(
            f"bucket {bucket.index} [{bucket.start}, {bucket.end}) is not padded to a multiple of the "
            f"data-parallel size {size} (build the buffers with pad_for_zero=True)"
        )
    length = numel // size
    return bucket.start + rank * length, bucket.start + (rank + 1) * length


def shard_slice(bucket: BucketLike, size: int) -> slice:
    """Where ``bucket``'s owned range lies in every rank's shard."""
    return slice(bucket.start // size, bucket.end // size)


def shard_ranges(buffer: BufferLike, rank: int, size: int, names: dict[int, str]) -> list[ShardRange]:
    """Every parameter range ``rank`` owns in ``buffer``, in shard order; ``names`` maps id(param) -> name."""
    ranges = []
    for bucket in buffer.buckets:
        own_start, own_end = owned_range(bucket, rank, size)
        base = shard_slice(bucket, size).start
        for p in bucket.params:
            start, end = buffer.ranges[id(p)]
            lo, hi = max(start, own_start), min(end, own_end)
            if lo < hi:
                ranges.append(
                    ShardRange(names[id(p)], p, bucket.index, lo - start, hi - start, lo, base + lo - own_start)
                )
    return sorted(ranges, key=lambda r: r.shard_start)
