"""Small corpora for the data tests: documents whose tokens say which document they came from."""

from __future__ import annotations

import numpy as np

from megacann.config import MegacannConfig
from megacann.data.indexed_dataset import write_indexed_dataset

EOS = 1
VOCAB = 1 << 20  # int32 files


def doc_tokens(doc: int, length: int, base: int = 0) -> list[int]:
    """Tokens of document ``doc``: base + 1000*doc + 2 + position (never EOS)."""
    return [base + 1000 * doc + 2 + j for j in range(length)]


def make_corpus(path, lengths, base: int = 0, eos_every: int = 2) -> str:
    """A pair of documents of the given lengths; every ``eos_every``-th already ends with EOS."""
    docs = []
    for d, n in enumerate(lengths):
        tokens = doc_tokens(d, n, base)
        docs.append(tokens + [EOS] if eos_every and d % eos_every == 0 else tokens)
    return write_indexed_dataset(str(path), docs, VOCAB)


def random_lengths(n: int, seed: int = 0, low: int = 1, high: int = 40) -> list[int]:
    return np.random.default_rng(seed).integers(low, high, size=n).tolist()


class FakeTokenizer:
    """Only what the pretraining path needs (ids of the fixtures' vocabulary)."""

    vocab_size, eos_id, bos_id, pad_id, fingerprint = VOCAB, EOS, None, 0, "fake"


def tiny_cfg(tmp_path, path=None, seq_length=16, batch_size=2, dp=1, accum=1, max_steps=20, **data) -> MegacannConfig:
    cfg = MegacannConfig()
    cfg.data.path = path
    cfg.data.seq_length, cfg.data.batch_size, cfg.data.num_workers = seq_length, batch_size, 0
    cfg.data.cache_dir = str(tmp_path / "cache")
    for key, value in data.items():
        setattr(cfg.data, key, value)
    cfg.distributed.data_parallel_size = dp
    cfg.optim.grad_accum_steps, cfg.optim.max_steps = accum, max_steps
    cfg.logging.eval_iters = 3
    return cfg
