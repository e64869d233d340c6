"""Packed pretraining samples: ``seq_length + 1`` tokens cut from documents laid end to end.

Each epoch lays the documents of a split end to end in a shuffled order, with EOS after every document
(added here when the data does not already end a document with EOS), and cuts the stream into samples
that overlap by one token (sample j holds stream tokens ``[j*s, j*s + s + 1)``); the tail shorter than a
sample is dropped. Samples are then shuffled within the epoch. Both orders depend only on ``(seed,
epoch)``, so the sample sequence of a longer run extends that of a shorter one: asking for more samples
(more steps) only appends epochs. Epoch indices are cached next to the data and built once, under a lock,
in blocks of whole epochs holding at least ``BLOCK_SAMPLES`` samples (so a tiny corpus repeated for many
epochs makes a few files, not one per epoch).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import numpy as np

from megacann.constants import IGNORE_INDEX
from megacann.data.cache import cache_root, cached_npy_dir, digest, writable_dir
from megacann.data.indexed_dataset import IndexedDataset, index_path
from megacann.data.random_order import permutation
from megacann.errors import MegacannError

BLOCK_SAMPLES = 1 << 16  # epochs are indexed in blocks of about this many samples (one block per small epoch)


class DatasetTooSmallError(MegacannError, ValueError):
    """A split with fewer tokens than one sample."""


def split_ranges(split: str, count: int) -> list[tuple[int, int]]:
    """Megatron-style ``"98,2,0"``: contiguous (train, valid, test) ranges of ``count`` documents."""
    try:
        weights = [float(w) for w in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"data.split: {split!r} is not comma-separated numbers like '98,2,0'") from None
    weights = (weights + [0.0, 0.0, 0.0])[:3]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"data.split: {split!r} must be non-negative weights with a positive sum")
    total = sum(weights)
    bounds = [0]
    for i in range(3):
        bounds.append(round(sum(weights[: i + 1]) / total * count))
    bounds[-1] = count
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def index_cache_dir(prefix: str, cache_dir: Optional[str]) -> str:
    """``cache_dir`` if given, else ``<data folder>/megacann_index`` when writable, else the user cache."""
    if cache_dir:
        return os.path.join(os.path.abspath(cache_dir), "index")
    beside = os.path.join(os.path.dirname(os.path.abspath(prefix)), "megacann_index")
    return beside if writable_dir(beside) else os.path.join(cache_root(), "index")


class GPTDataset:
    """Packed samples from documents ``[begin, end)`` of an :class:`IndexedDataset`.

    Call :meth:`prepare` with the number of samples needed before indexing; ``ds[i]`` is then an int64
    array of ``seq_length + 1`` tokens. ``samples_per_epoch`` is known from construction.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_range: tuple[int, int],
        seq_length: int,
        seed: int,
        eos_id: int,
        cache_dir: Optional[str] = None,
    ):
        self.indexed, self.seq_length, self.seed, self.eos_id = indexed, seq_length, seed, eos_id
        self.begin, self.end = doc_range
        idx_file = index_path(indexed.prefix)
        stat = os.stat(idx_file)
        key = digest(os.path.realpath(idx_file), stat.st_size, stat.st_mtime_ns, self.begin, self.end, eos_id)
        name = os.path.basename(indexed.prefix)
        self._cache = os.path.join(index_cache_dir(indexed.prefix, cache_dir), f"{name}-{key}")
        self._add_eos = cached_npy_dir(os.path.join(self._cache, "docs"), self._find_missing_eos)["add_eos"]
        lengths = indexed.sequence_lengths[self.begin : self.end].astype(np.int64)
        self._doc_tokens = lengths + self._add_eos
        self.num_tokens = int(self._doc_tokens.sum())
        self.samples_per_epoch = max((self.num_tokens - 1) // seq_length, 0)
        self.epochs_per_block = max(1, math.ceil(BLOCK_SAMPLES / max(self.samples_per_epoch, 1)))
        self.num_samples = 0
        self._blocks: list[dict[str, np.ndarray]] = []

    def describe(self) -> str:
        return f"{self.indexed.prefix} documents [{self.begin}, {self.end})"

    def _find_missing_eos(self) -> dict[str, np.ndarray]:
        last = self.indexed.last_tokens(self.begin, self.end)
        return {"add_eos": ((last >= 0) & (last != self.eos_id)).astype(np.int8)}

    def prepare(self, num_samples: int) -> GPTDataset:
        """Make samples ``0 .. num_samples-1`` addressable (building or loading epoch indices)."""
        if num_samples > 0 and self.samples_per_epoch == 0:
            raise DatasetTooSmallError(
                f"{self.describe()}: {self.num_tokens} tokens, fewer than seq_length + 1 = {self.seq_length + 1}"
            )
        epochs = math.ceil(num_samples / self.samples_per_epoch) if num_samples else 0
        blocks = math.ceil(epochs / self.epochs_per_block)
        for block in range(len(self._blocks), blocks):
            name = f"s{self.seq_length}-seed{self.seed}-epochs{block * self.epochs_per_block}+{self.epochs_per_block}"
            self._blocks.append(cached_npy_dir(os.path.join(self._cache, name), lambda b=block: self._build_block(b)))
        self.num_samples = max(self.num_samples, num_samples)
        return self

    def _build_block(self, block: int) -> dict[str, np.ndarray]:
        """Rows of per-epoch indices: document order, document end positions, sample order."""
        epochs = range(block * self.epochs_per_block, (block + 1) * self.epochs_per_block)
        orders = np.stack([permutation(self.end - self.begin, self.seed, e, 1) for e in epochs])
        ends = np.cumsum(self._doc_tokens[orders], axis=1)
        shuffles = np.stack([permutation(self.samples_per_epoch, self.seed, e, 2) for e in epochs])
        return {"doc_order": orders, "doc_ends": ends, "sample_order": shuffles}

    def epoch_index(self, epoch: int) -> dict[str, np.ndarray]:
        """The index arrays of one (prepared) epoch."""
        block, row = divmod(epoch, self.epochs_per_block)
        return {key: value[row] for key, value in self._blocks[block].items()}

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.describe()}: sample {i} out of range (prepared {self.num_samples})")
        epoch, local = divmod(int(i), self.samples_per_epoch)
        index = self.epoch_index(epoch)
        ends, order = index["doc_ends"], index["doc_order"]
        start = int(index["sample_order"][local]) * self.seq_length
        need = self.seq_length + 1
        out = np.empty(need, dtype=np.int64)
        filled = 0
        k = int(np.searchsorted(ends, start, side="right"))
        offset = start - (int(ends[k - 1]) if k else 0)
        while filled < need:
            doc = int(order[k])
            seq = self.begin + doc
            length = int(self.indexed.sequence_lengths[seq])
            take = min(length - offset, need - filled) if offset < length else 0
            if take > 0:
                out[filled : filled + take] = self.indexed.get(seq, offset, take)
                filled += take
            if filled < need and self._add_eos[doc] and offset + take == length:
                out[filled] = self.eos_id
                filled += 1
            k, offset = k + 1, 0
        return out


def pretrain_fields(
    sample: np.ndarray,
    eos_id: int,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
) -> dict[str, np.ndarray]:
    """Model inputs from ``seq_length + 1`` tokens: inputs, next-token labels, positions, segments.

    Documents end at EOS: the token after an EOS starts a new document (new segment id; position 0 when
    ``reset_position_ids``). ``segment_ids`` is present only with ``reset_attention_mask``. With
    ``eod_mask_loss`` the prediction made *at* an EOS (the next document's first token) carries no loss.
    """
    tokens = np.ascontiguousarray(sample[:-1], dtype=np.int64)
    labels = np.array(sample[1:], dtype=np.int64)
    is_eos = tokens == eos_id
    if eod_mask_loss:
        labels[is_eos] = IGNORE_INDEX
    out = {"tokens": tokens, "labels": labels}
    positions = np.arange(len(tokens), dtype=np.int64)
    segment = np.zeros(len(tokens), dtype=np.int64)
    np.cumsum(is_eos[:-1], out=segment[1:])
    if reset_position_ids:
        starts = np.concatenate([[0], np.flatnonzero(is_eos[:-1]) + 1])
        positions -= starts[segment]
    out["position_ids"] = positions
    if reset_attention_mask:
        out["segment_ids"] = segment
    return out
