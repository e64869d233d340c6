"""Blending several datasets by weight, deterministically and prefix-stably.

Dataset ``d`` with normalised weight ``w_d`` supplies its k-th sample at "time" ``(k + 1/2) / w_d``; the
blended order is all these times sorted (ties by dataset number). So after any n blended samples each
dataset has supplied within one sample of ``n * w_d``, no random numbers are involved, and the first n
samples are the same whatever total is asked for: a longer run extends a shorter one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def normalize_weights(weights: Sequence[float], what: str = "data.weights") -> np.ndarray:
    w = np.asarray([float(x) for x in weights], dtype=np.float64)
    if w.size == 0 or np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(f"{what}: {list(weights)} must be non-negative numbers with a positive sum")
    return w / w.sum()


def blend_index(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """For blended samples 0..num_samples-1: (dataset number int32, sample number in that dataset int64)."""
    w = normalize_weights(weights)
    times, which, rank = [], [], []
    for d, wd in enumerate(w):
        if wd == 0:
            continue
        count = math.ceil((num_samples + len(w)) * wd) + 2
        k = np.arange(count, dtype=np.int64)
        times.append((k + 0.5) / wd)
        which.append(np.full(count, d, dtype=np.int32))
        rank.append(k)
    all_times, all_which = np.concatenate(times), np.concatenate(which)
    order = np.lexsort((all_which, all_times))[:num_samples]
    return all_which[order], np.concatenate(rank)[order]


class BlendedDataset:
    """Samples of several datasets interleaved by :func:`blend_index`. Each component must offer
    ``prepare(n)`` and ``__getitem__``; they are prepared for exactly the samples the blend draws."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.num_samples = num_samples
        self.dataset_index, self.sample_index = blend_index(self.weights, num_samples)
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for dataset, count in zip(self.datasets, counts):
            dataset.prepare(int(count))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(f"blended sample {i} out of range ({self.num_samples})")
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]
