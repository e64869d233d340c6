"""SFT sequences: tokenized samples packed (or padded) into sequences of ``seq_length`` tokens.

Packing is greedy in a seeded order: samples are appended to the current sequence while they fit, then a
new one starts; packs are formed once and each epoch visits them in its own seeded order. Inside a pack
every sample keeps its own positions (from 0) and segment id, labels never cross from one sample into the
next, and the padding at the end has its own segment and no loss. Without packing each sequence holds one
sample followed by padding, and no ``segment_ids`` are needed (causal attention never looks at later pads).
"""

from __future__ import annotations

import numpy as np

from megacann.constants import IGNORE_INDEX
from megacann.data.epochs import EpochDataset
from megacann.data.random_order import permutation


def greedy_packs(lengths: list[int], order: np.ndarray, seq_length: int) -> list[list[int]]:
    """Consecutive runs of ``order`` whose lengths sum to at most ``seq_length``."""
    packs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order.tolist():
        if current and used + lengths[i] > seq_length:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += lengths[i]
    if current:
        packs.append(current)
    return packs


class SFTDataset(EpochDataset):
    """Sequences of ``seq_length`` tokens from SFT samples; items are dicts of model inputs (NumPy)."""

    def __init__(
        self,
        samples: list[tuple[np.ndarray, np.ndarray]],
        seq_length: int,
        seed: int,
        pad_id: int,
        pack: bool = True,
        name: str = "sft",
    ):
        if not samples:
            raise ValueError(f"{name}: no SFT samples to train on")
        self.samples, self.seq_length, self.pad_id, self.pack = samples, seq_length, pad_id, pack
        order = permutation(len(samples), seed, 0, 3)
        if pack:
            self.packs = greedy_packs([len(ids) for ids, _ in samples], order, seq_length)
        else:
            self.packs = [[int(i)] for i in order]
        super().__init__(len(self.packs), seed, name)

    @property
    def fill_ratio(self) -> float:
        """Share of sequence positions holding sample tokens (not padding)."""
        used = sum(len(ids) for ids, _ in self.samples)
        return used / (self.samples_per_epoch * self.seq_length)

    def item(self, epoch: int, local: int) -> dict[str, np.ndarray]:
        return self.sequence(self.packs[int(self.epoch_order(epoch, self.samples_per_epoch, 4)[local])])

    def sequence(self, members: list[int]) -> dict[str, np.ndarray]:
        """Model inputs for one pack of sample indices."""
        s = self.seq_length
        tokens = np.full(s, self.pad_id, dtype=np.int64)
        labels = np.full(s, IGNORE_INDEX, dtype=np.int64)
        positions = np.arange(s, dtype=np.int64)
        segments = np.full(s, len(members), dtype=np.int64)  # padding: a segment of its own
        at = 0
        for segment, index in enumerate(members):
            ids, mask = self.samples[index]
            n = len(ids)
            tokens[at : at + n] = ids
            labels[at : at + n - 1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
            positions[at : at + n] = np.arange(n)
            segments[at : at + n] = segment
            at += n
        positions[at:] = np.arange(s - at)
        out = {"tokens": tokens, "labels": labels, "position_ids": positions}
        if self.pack:
            out["segment_ids"] = segments
        return out
