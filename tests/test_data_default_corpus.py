"""The embedded default corpus (stdlib sources + a BPE trained on them): built once, fast, cached, real text."""

import os

import numpy as np
import pytest
from data_fixtures import tiny_cfg

from megacann.data import IndexedDataset, build_data_iterators, build_tokenizer
from megacann.data.default_corpus import corpus_dir, stdlib_sources


def _files(root: str) -> dict[str, float]:
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns for d, _, fs in os.walk(root) for f in fs}


@pytest.mark.extended
def test_default_corpus_builds_once_then_loads_from_cache(tmp_path):
    cfg = tiny_cfg(tmp_path, seq_length=256, batch_size=8, max_steps=50)
    tokenizer = build_tokenizer(cfg)
    data = build_data_iterators(cfg, tokenizer)
    assert tokenizer.vocab_size == cfg.data.tokenizer_vocab_size == 8192
    built = _files(cfg.data.cache_dir)

    tokenizer2 = build_tokenizer(cfg)
    data2 = build_data_iterators(cfg, tokenizer2)
    first = next(data2.train)
    assert _files(cfg.data.cache_dir) == built  # nothing rebuilt or rewritten: everything came from the cache
    assert tokenizer2.fingerprint == tokenizer.fingerprint
    assert all(np.array_equal(first[k], v) for k, v in next(data.train).items())  # same data, same order

    text = tokenizer.decode(first["tokens"][0].tolist())
    assert len(text) > 500 and text.count("\n") > 5  # real source text, not noise
    assert data.valid() is not None  # 2% of the files are held out

    relpaths = stdlib_sources()
    assert len(relpaths) > 300 and not any(p.startswith(("test/", "site-packages/")) for p in relpaths)
    prefixes = [f[:-4] for f in os.listdir(corpus_dir(cfg.data.cache_dir)) if f.endswith(".idx")]
    corpus = IndexedDataset(os.path.join(corpus_dir(cfg.data.cache_dir), prefixes[0]))
    assert len(corpus) == len(relpaths) and corpus.num_tokens > 1_000_000
    assert all(corpus[i][-1] == tokenizer.eos_id for i in range(0, len(corpus), 50))
