"""Distributed sampling by consumed samples.

The train split is one deterministic sequence of samples. Global step k consumes samples
``[k*G, (k+1)*G)`` with G the global batch; within it, each micro-step takes the next
``micro_batch_size * dp_size`` samples and data-parallel rank r takes its slice ``[r*b, (r+1)*b)`` of them.
The only state is the number of consumed samples: a resumed run continues on exactly the next sample, and
a run resumed with another data-parallel size continues the same global order (only the split of each
micro-step across ranks changes). Tensor-, pipeline- and context-parallel ranks of one data-parallel rank
pass the same ``dp_rank`` and so read identical batches.
"""

from __future__ import annotations

from collections.abc import Iterator


class ConsumedSamplesSampler:
    """Batch sampler yielding this rank's micro-batches of sample indices, from ``consumed_samples`` on."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        if micro_batch_size < 1 or dp_size < 1:
            raise ValueError(f"micro_batch_size {micro_batch_size} and dp_size {dp_size} must be positive")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size

    @property
    def _stride(self) -> int:
        return self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        return max(self.total_samples - self.consumed_samples, 0) // self._stride

    def __iter__(self) -> Iterator[list[int]]:
        first = self.consumed_samples + self.dp_rank * self.micro_batch_size
        for step in range(len(self)):
            start = first + step * self._stride
            yield list(range(start, start + self.micro_batch_size))
