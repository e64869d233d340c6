"""Data pipeline: tokenizers, Megatron ``.bin``/``.idx`` data, packing, resumable sampling, SFT data,
preference pairs (DPO).

The trainer's contract::

    tokenizer = build_tokenizer(cfg)
    data = build_data_iterators(cfg, tokenizer, consumed_samples=0, dp_rank=0, dp_size=1)
    batch = next(data.train)   # {tokens, labels, position_ids[, segment_ids]}: [b, s] int64 CPU tensors
    it = data.valid()          # a fresh held-out iterator (same batches each call), or None

Labels are next-token targets with IGNORE_INDEX (-100, from megacann.constants) where no loss is taken; ``segment_ids`` is present only when
attention must not cross documents or samples (equal ids = same document). See docs/data.md.

Names are imported on first use, so ``megacann.data.preprocess`` and its worker processes do not load torch.
"""

from __future__ import annotations

from megacann.lazy_exports import lazy_exports

_EXPORTS = {
    "DataIterators": "builders",
    "build_data_iterators": "builders",
    "build_pretrain_datasets": "builders",
    "build_sft_datasets": "builders",
    "build_tokenizer": "builders",
    "IGNORE_INDEX": "gpt_dataset",  # defined in megacann.constants
    "GPTDataset": "gpt_dataset",
    "pretrain_fields": "gpt_dataset",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetBuilder": "indexed_dataset",
    "write_indexed_dataset": "indexed_dataset",
    "ConsumedSamplesSampler": "sampler",
    "SFTDataError": "sft",
    "PreferenceDataError": "preference",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "SentencePieceTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_bpe": "tokenizer",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
