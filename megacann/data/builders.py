"""From a recipe to a tokenizer and to train / held-out micro-batch iterators (the trainer's entry points).

Global order: the train split is one deterministic sequence of samples, ``max_steps x global batch`` long
(epochs repeat as needed); global step k consumes samples ``[k*G, (k+1)*G)``. See ``sampler.py`` for how a
step is divided among data-parallel ranks and micro-steps, and ``docs/data.md`` for the user's view.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from typing import Optional

from megacann.data.blend import BlendedDataset
from megacann.data.default_corpus import default_corpus_prefix, default_tokenizer
from megacann.data.gpt_dataset import GPTDataset, pretrain_fields, split_ranges
from megacann.data.indexed_dataset import IndexedDataset
from megacann.data.loader import build_loader, default_pin_memory
from megacann.data.sampler import ConsumedSamplesSampler
from megacann.data.sft import cached_sft_samples
from megacann.data.sft_dataset import SFTDataset
from megacann.data.sft_templates import get_template
from megacann.data.sources import DataPathError, resolve_sources
from megacann.data.tokenizer import TokenizerError, load_tokenizer


def _log(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[megacann.data] {message}", file=sys.stderr, flush=True)


def build_tokenizer(cfg):
    """``data.tokenizer`` None: the BPE trained on the default corpus (cached); else 'byte', a
    tokenizer.json, a Hugging Face tokenizer directory or a SentencePiece .model."""
    d = cfg.data
    if d.tokenizer is None:
        return default_tokenizer(d.cache_dir, d.tokenizer_vocab_size, verbose=os.environ.get("RANK", "0") == "0")
    try:
        return load_tokenizer(d.tokenizer)
    except TokenizerError as err:
        raise TokenizerError(f"data.tokenizer: {err}") from None


def _combine(parts: list, weights: list, num_samples: int):
    """One dataset prepared for ``num_samples``: the single part itself, or a blend of several."""
    if len(parts) == 1:
        return parts[0].prepare(num_samples)
    return BlendedDataset(parts, weights, num_samples)


def _assemble(splits: list[tuple[Optional[float], object, object, float]], train_n: int, valid_n: int, what: str):
    """``splits``: (weight or None, train part or None, valid part or None, size for size-weighting)."""
    train = [(w if w is not None else size, t) for w, t, _, size in splits if t is not None]
    train = [(w, t) for w, t in train if w > 0]
    if not train:
        raise DataPathError(
            f"{what}: the train split holds no usable sample (check data.split and data.weights; SFT records "
            "whose answer lies beyond data.seq_length are dropped)"
        )
    valid = [(w if w is not None else size, v) for w, _, v, size in splits if v is not None and v.samples_per_epoch > 0]
    valid = [(w, v) for w, v in valid if w > 0]
    train_ds = _combine([t for _, t in train], [w for w, _ in train], train_n)
    valid_ds = _combine([v for _, v in valid], [w for w, _ in valid], valid_n) if valid and valid_n > 0 else None
    return train_ds, valid_ds


def build_pretrain_datasets(cfg, tokenizer, train_samples: int, valid_samples: int):
    """(train, valid or None) packed-token datasets for ``data.path`` (None: the default corpus)."""
    d = cfg.data
    if d.path is None:
        sources = [(None, default_corpus_prefix(tokenizer, d.cache_dir))]
    else:
        sources = resolve_sources(d.path, d.weights)
    splits = []
    for weight, prefix in sources:
        indexed = IndexedDataset(prefix)
        ranges = split_ranges(d.split, len(indexed))
        parts = [
            GPTDataset(indexed, r, d.seq_length, cfg.seed, tokenizer.eos_id, d.cache_dir) if r[1] > r[0] else None
            for r in ranges[:2]
        ]
        size = parts[0].num_tokens if parts[0] is not None else 0
        splits.append((weight, parts[0], parts[1], size))
    return _assemble(splits, train_samples, valid_samples, "data.path")


def build_sft_datasets(cfg, tokenizer, train_samples: int, valid_samples: int):
    """(train, valid or None) SFT sequence datasets for the JSONL files of ``data.path``."""
    d = cfg.data
    if d.path is None:
        raise ValueError("train_mode sft needs data.path: JSONL file(s) of instruction/output or messages records")
    template = get_template(d.prompt_template)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    splits = []
    for weight, path in resolve_sources(d.path, d.weights, sft=True):
        samples, stats, built = cached_sft_samples(
            path, tokenizer, template, d.seq_length, d.skip_bad_lines, d.cache_dir
        )
        _log(f"{path}: {stats.summary()} ({'tokenized and cached' if built else 'from the cache'})")
        ranges = split_ranges(d.split, len(samples))
        parts = [
            SFTDataset(samples[a:b], d.seq_length, cfg.seed, pad_id, d.pack_sft, name=f"{path} [{a}, {b})")
            if b > a
            else None
            for a, b in ranges[:2]
        ]
        size = ranges[0][1] - ranges[0][0]
        splits.append((weight, parts[0], parts[1], size))
    return _assemble(splits, train_samples, valid_samples, "data.path")


class DataIterators:
    """``train``: an iterator of this rank's micro-batches from ``consumed_samples`` on. ``valid()``: a fresh
    iterator over the same held-out micro-batches each call (``logging.eval_iters`` global batches' worth),
    or None when the split holds none."""

    def __init__(self, cfg, train_dataset, valid_dataset, transform, consumed_samples: int, dp_rank: int, dp_size: int):
        d = cfg.data
        self.train_dataset, self.valid_dataset = train_dataset, valid_dataset
        self.train_samples = len(train_dataset)
        self._cfg, self._transform = cfg, transform
        self._dp_rank, self._dp_size = dp_rank, dp_size
        pin = d.pin_memory if d.pin_memory is not None else default_pin_memory(cfg.distributed.device)
        self._pin = pin
        sampler = ConsumedSamplesSampler(self.train_samples, consumed_samples, d.batch_size, dp_rank, dp_size)
        self.train_loader = build_loader(
            train_dataset, sampler, d.num_workers, d.persistent_workers, pin, cfg.seed, dp_rank, transform
        )
        self.train: Iterator[dict] = iter(self.train_loader)

    def valid(self) -> Optional[Iterator[dict]]:
        if self.valid_dataset is None:
            return None
        d = self._cfg.data
        sampler = ConsumedSamplesSampler(len(self.valid_dataset), 0, d.batch_size, self._dp_rank, self._dp_size)
        loader = build_loader(
            self.valid_dataset, sampler, 0, False, self._pin, self._cfg.seed, self._dp_rank, self._transform
        )
        return iter(loader)


def build_data_iterators(
    cfg,
    tokenizer,
    consumed_samples: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
    remaining_steps: Optional[int] = None,
) -> DataIterators:
    """Train and held-out iterators for the recipe from ``consumed_samples`` on (the samples of the steps
    done, whatever global batch they had). The train order holds ``max_steps x global batch`` samples, or,
    when a resumed run has ``remaining_steps`` to go with a different global batch than it had, enough
    for those steps after the consumed samples."""
    d = cfg.data
    global_batch = cfg.global_batch_size
    train_n = cfg.optim.max_steps * global_batch
    if remaining_steps is not None:  # a resumed run whose global batch changed (another data-parallel size)
        train_n = max(train_n, consumed_samples + max(0, remaining_steps) * global_batch)
    valid_n = max(cfg.logging.eval_iters, 1) * global_batch
    catalog = None
    if cfg.train_mode == "sft":
        train, valid = build_sft_datasets(cfg, tokenizer, train_n, valid_n)
        transform = None
    elif cfg.train_mode == "dpo":  # pairs of sequences, chosen then rejected (megacann.data.preference_dataset)
        from megacann.data.preference_dataset import build_preference_datasets

        train, valid, catalog = build_preference_datasets(cfg, tokenizer, train_n, valid_n)
        transform = None
    else:
        train, valid = build_pretrain_datasets(cfg, tokenizer, train_n, valid_n)
        transform = functools.partial(
            pretrain_fields,
            eos_id=tokenizer.eos_id,
            reset_position_ids=d.reset_position_ids,
            reset_attention_mask=d.reset_attention_mask,
            eod_mask_loss=d.eod_mask_loss,
        )
    if valid is None:
        _log("no held-out samples (data.split gives the validation split nothing); data.valid() returns None")
    iterators = DataIterators(cfg, train, valid, transform, consumed_samples, dp_rank, dp_size)
    iterators.preference_catalog = catalog  # DPO: every sequence, for precomputed reference log-probs
    return iterators
