"""Preference sequences: each pair's chosen and rejected sequence side by side in the sample order.

Sample ``2k`` of the dataset is the chosen sequence of a pair and sample ``2k + 1`` its rejected one, so a
micro-batch of an even number of samples (``data.batch_size``, checked even in DPO) always holds whole
pairs, chosen first: on every data-parallel rank, micro-batch and pipeline stage. Pairs are visited in a
seeded order per epoch; every sequence is one sample followed by padding (no packing). Each item carries
``sequence_index``: the sequence's place in the whole data (all files, before the split), the key of
precomputed reference log-probabilities.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

from megacann.constants import IGNORE_INDEX
from megacann.data.epochs import EpochDataset
from megacann.data.jsonl_records import Sample


def preference_sequence(sample: Sample, seq_length: int, pad_id: int, sequence_index: int) -> dict[str, np.ndarray]:
    """Model inputs of one sequence, padded to ``seq_length``; labels only on the trained response."""
    ids, mask = sample
    n = len(ids)
    tokens = np.full(seq_length, pad_id, dtype=np.int64)
    labels = np.full(seq_length, IGNORE_INDEX, dtype=np.int64)
    tokens[:n] = ids
    labels[: n - 1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
    return {
        "tokens": tokens,
        "labels": labels,
        "position_ids": np.arange(seq_length, dtype=np.int64),
        "sequence_index": np.asarray(sequence_index, dtype=np.int64),
    }


class PreferenceDataset(EpochDataset):
    """Sequences of ``seq_length`` tokens, chosen then rejected for each pair of ``samples``
    (``[chosen_0, rejected_0, chosen_1, ...]``; ``global_index[i]``: sample i's place in the whole data)."""

    def __init__(
        self, samples: list[Sample], global_index: np.ndarray, seq_length: int, seed: int, pad_id: int, name: str
    ):
        if not samples or len(samples) % 2 or len(global_index) != len(samples):
            raise ValueError(f"{name}: no preference pairs to train on")
        super().__init__(len(samples), seed, name)
        self.samples, self.seq_length, self.pad_id, self.global_index = samples, seq_length, pad_id, global_index
        self.num_pairs = len(samples) // 2

    def item(self, epoch: int, local: int) -> dict[str, np.ndarray]:
        pair = int(self.epoch_order(epoch, self.num_pairs, 5)[local // 2])
        return self.sequence(2 * pair + local % 2)

    def sequence(self, index: int) -> dict[str, np.ndarray]:
        """Model inputs of local sample ``index``."""
        return preference_sequence(self.samples[index], self.seq_length, self.pad_id, int(self.global_index[index]))


@dataclass
class PreferenceCatalog:
    """Every sequence of the preference data in global order (all files, train and held-out parts), with
    the cache directories that identify the tokenized data: what precomputed reference log-probabilities
    are computed over and keyed by."""

    samples: list[Sample]
    cache_dirs: list[str]
    seq_length: int
    pad_id: int

    def sequence(self, index: int) -> dict[str, np.ndarray]:
        """Model inputs of global sequence ``index``."""
        return preference_sequence(self.samples[index], self.seq_length, self.pad_id, index)


def build_preference_datasets(cfg, tokenizer, train_samples: int, valid_samples: int):
    """(train, valid or None, catalog) preference datasets for the JSONL files of ``data.path``: each
    file's pairs split by ``data.split``, the files' train (held-out) parts concatenated."""
    from megacann.data.gpt_dataset import split_ranges
    from megacann.data.preference import cached_preference_pairs
    from megacann.data.sft_templates import get_template
    from megacann.data.sources import DataPathError, resolve_sources

    d = cfg.data
    if d.path is None:
        raise ValueError("train_mode dpo needs data.path: JSONL file(s) of prompt/chosen/rejected records")
    template = get_template(d.prompt_template)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    everything: list[Sample] = []
    parts: tuple[list, list] = ([], [])  # (global first index, samples) of each file's train / held-out part
    dirs = []
    for _, path in resolve_sources(d.path, None, sft=True):
        samples, stats, built, directory = cached_preference_pairs(
            path, tokenizer, template, d.seq_length, d.skip_bad_lines, d.cache_dir
        )
        _log(f"{path}: {stats.summary()} ({'tokenized and cached' if built else 'from the cache'})")
        for target, (a, b) in zip(parts, split_ranges(d.split, len(samples) // 2)[:2]):
            if b > a:
                target.append((len(everything) + 2 * a, samples[2 * a : 2 * b]))
        everything += samples
        dirs.append(directory)
    catalog = PreferenceCatalog(everything, dirs, d.seq_length, pad_id)
    datasets = []
    for part, wanted in zip(parts, (train_samples, valid_samples)):
        datasets.append(_joined(part, d.seq_length, cfg.seed, pad_id).prepare(wanted) if part else None)
    if datasets[0] is None:
        raise DataPathError("data.path: the train split holds no preference pair (check data.split)")
    return datasets[0], datasets[1] if valid_samples > 0 else None, catalog


def _joined(parts: list[tuple[int, list[Sample]]], seq_length: int, seed: int, pad_id: int) -> PreferenceDataset:
    """One dataset over several files' parts, each keeping its global indices."""
    samples = [s for _, part in parts for s in part]
    index = np.concatenate([np.arange(first, first + len(part)) for first, part in parts])
    return PreferenceDataset(samples, index, seq_length, seed, pad_id, "preference data")


def _log(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[megacann.data] {message}", file=sys.stderr, flush=True)
