"""The torch DataLoader around a dataset and the consumed-samples sampler.

Workers are seeded from the global seed (and the data-parallel rank), so anything random in a worker is
reproducible; the sample order itself never depends on workers. Memory is pinned when the device is an
accelerator (``data.pin_memory: null``) or when asked.
"""

from __future__ import annotations

import random
import signal
from typing import Callable, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from megacann.data.sampler import ConsumedSamplesSampler


class MappedDataset(torch.utils.data.Dataset):
    """``transform(dataset[i])``: raw packed tokens -> model inputs in the worker, not the trainer."""

    def __init__(self, dataset, transform: Optional[Callable] = None):
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        item = self.dataset[i]
        return self.transform(item) if self.transform is not None else item


def collate(items: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack per-sample arrays into [b, s] int64 tensors."""
    return {
        key: torch.from_numpy(np.stack([item[key] for item in items]).astype(np.int64, copy=False)) for key in items[0]
    }


def _seed_worker(worker_id: int) -> None:
    # Ctrl-C reaches every process of the terminal: the trainer decides when to stop (after a step, with a
    # checkpoint), so a worker must not die mid-step of its KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seed = torch.initial_seed() % (2**32)  # set by the DataLoader from our seeded generator + worker_id
    np.random.seed(seed)
    random.seed(seed)


def worker_base_seed(seed: int, dp_rank: int) -> int:
    return (seed * 1_000_003 + dp_rank * 7919) % (2**63)


def default_pin_memory(device: Optional[str]) -> bool:
    """Pin host memory when batches go to an NPU or a GPU."""
    from megacann.accelerator import resolve_device_type

    try:
        return resolve_device_type(device) in ("cuda", "npu")
    except ValueError:
        return False


def build_loader(
    dataset,
    sampler: ConsumedSamplesSampler,
    num_workers: int = 0,
    persistent_workers: bool = False,
    pin_memory: bool = False,
    seed: int = 0,
    dp_rank: int = 0,
    transform: Optional[Callable] = None,
) -> DataLoader:
    generator = torch.Generator()
    generator.manual_seed(worker_base_seed(seed, dp_rank))
    return DataLoader(
        MappedDataset(dataset, transform),
        batch_sampler=sampler,
        num_workers=num_workers,
        persistent_workers=persistent_workers and num_workers > 0,
        pin_memory=pin_memory,
        collate_fn=collate,
        worker_init_fn=_seed_worker if num_workers > 0 else None,
        generator=generator,
    )
