"""A dataset that visits a fixed set of items once per epoch, each epoch in its own seeded order.

SFT sequences (packs) and preference pairs are read this way: the sampler asks for global sample ``i``;
``i`` falls in epoch ``i // samples_per_epoch``, whose order is a permutation drawn from the seed, the
epoch and a stream number of the dataset's kind (:func:`megacann.data.random_order.permutation`), so a
resumed run reads the same items.
"""

from __future__ import annotations

import numpy as np

from megacann.data.random_order import permutation


class EpochDataset:
    """Base of the datasets above: subclasses set ``samples_per_epoch`` and give :meth:`item`."""

    def __init__(self, samples_per_epoch: int, seed: int, name: str):
        self.samples_per_epoch, self.seed, self.name = samples_per_epoch, seed, name
        self.num_samples = 0
        self._orders: dict[tuple[int, int, int], np.ndarray] = {}

    def prepare(self, num_samples: int):
        """Make samples ``0 .. num_samples - 1`` readable (the sampler's count; never shrinks)."""
        self.num_samples = max(self.num_samples, num_samples)
        return self

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name}: sequence {i} out of range (prepared {self.num_samples})")
        epoch, local = divmod(int(i), self.samples_per_epoch)
        return self.item(epoch, local)

    def epoch_order(self, epoch: int, n: int, stream: int) -> np.ndarray:
        """The seeded order of ``n`` things in ``epoch`` (``stream`` keeps the kinds' orders apart)."""
        key = (epoch, n, stream)
        if key not in self._orders:
            self._orders[key] = permutation(n, self.seed, epoch, stream)
        return self._orders[key]

    def item(self, epoch: int, local: int) -> dict[str, np.ndarray]:
        raise NotImplementedError
