"""Data pipeline: tokenizers, Megatron ``.bin``/``.idx`` data, packing, resumable sampling, SFT data.

The trainer's contract::

    tokenizer = build_tokenizer(cfg)
    data = build_data_iterators(cfg, tokenizer, consumed_samples=0, dp_rank=0, dp_size=1)
    batch = next(data.train)   # {tokens, labels, position_ids[, segment_ids]}: [b, s] int64 CPU tensors
    it = data.valid()          # a fresh held-out iterator (same batches each call), or None

Labels are next-token targets with -100 where no loss is taken; ``segment_ids`` is present only when
attention must not cross documents or samples (equal ids = same document). See docs/data.md.
"""

from megacann.data.builders import (
    DataIterators,
    build_data_iterators,
    build_pretrain_datasets,
    build_sft_datasets,
    build_tokenizer,
)
from megacann.data.gpt_dataset import IGNORE_INDEX, GPTDataset, pretrain_fields
from megacann.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, write_indexed_dataset
from megacann.data.sampler import ConsumedSamplesSampler
from megacann.data.sft import SFTDataError
from megacann.data.tokenizer import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, load_tokenizer, train_bpe

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "ConsumedSamplesSampler",
    "DataIterators",
    "GPTDataset",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "SFTDataError",
    "SentencePieceTokenizer",
    "build_data_iterators",
    "build_pretrain_datasets",
    "build_sft_datasets",
    "build_tokenizer",
    "load_tokenizer",
    "pretrain_fields",
    "train_bpe",
    "write_indexed_dataset",
]
