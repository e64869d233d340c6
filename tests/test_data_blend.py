"""Blending datasets by weight, and the forms of data.path."""

import numpy as np
import pytest
from data_fixtures import FakeTokenizer, make_corpus, random_lengths, tiny_cfg

from megacann.data.blend import blend_index
from megacann.data.builders import build_pretrain_datasets
from megacann.data.sources import DataPathError, resolve_sources

BASES = (0, 300_000, 600_000)


def corpora(tmp_path, sizes=(60, 40, 30)):
    return [
        make_corpus(tmp_path / f"part{i}", random_lengths(n, seed=i), base=b)
        for i, (n, b) in enumerate(zip(sizes, BASES))
    ]


def source_of(sample) -> int:
    return int(np.max(sample)) // 300_000


def test_blend_index_tracks_weights_at_every_prefix():
    weights = [0.5, 0.3, 0.2]
    which, rank = blend_index(weights, 5000)
    counts = np.zeros((5000, 3))
    counts[np.arange(5000), which] = 1
    running = np.cumsum(counts, axis=0)
    expected = np.outer(np.arange(1, 5001), weights)
    assert np.abs(running - expected).max() <= 1.0
    for d in range(3):  # each dataset's own samples are drawn in order 0, 1, 2, ...
        assert rank[which == d].tolist() == list(range(int((which == d).sum())))
    shorter = blend_index(weights, 1234)
    assert np.array_equal(shorter[0], which[:1234]) and np.array_equal(shorter[1], rank[:1234])


def test_blended_weights_respected_within_tolerance(tmp_path):
    p0, p1, p2 = corpora(tmp_path)
    cfg = tiny_cfg(tmp_path, path=[0.5, p0, 0.3, p1, 0.2, p2], seq_length=8, split="100,0,0")
    train, valid = build_pretrain_datasets(cfg, FakeTokenizer(), 3000, 0)
    assert valid is None
    share = np.bincount([source_of(train[i]) for i in range(len(train))], minlength=3) / len(train)
    assert np.allclose(share, [0.5, 0.3, 0.2], atol=0.01)


def test_weights_key_and_size_weighting(tmp_path):
    parts = corpora(tmp_path)
    cfg = tiny_cfg(tmp_path, path=parts, weights=[1, 1, 2], seq_length=8, split="100,0,0")
    train, _ = build_pretrain_datasets(cfg, FakeTokenizer(), 2000, 0)
    share = np.bincount([source_of(train[i]) for i in range(2000)], minlength=3) / 2000
    assert np.allclose(share, [0.25, 0.25, 0.5], atol=0.01)
    cfg.data.weights = None  # no weights: in proportion to tokens, like one concatenated corpus
    train, _ = build_pretrain_datasets(cfg, FakeTokenizer(), 2000, 0)
    tokens = np.array([d.num_tokens for d in train.datasets], dtype=float)
    share = np.bincount([source_of(train[i]) for i in range(2000)], minlength=3) / 2000
    assert np.allclose(share, tokens / tokens.sum(), atol=0.01)


def test_data_path_forms(tmp_path):
    parts = corpora(tmp_path)
    assert resolve_sources(str(tmp_path)) == [(None, p) for p in parts]  # a directory: all pairs, by name
    assert resolve_sources(parts[0] + ".bin") == [(None, parts[0])]
    assert resolve_sources(["2", parts[0], "1", parts[1]]) == [(2.0, parts[0]), (1.0, parts[1])]
    with pytest.raises(DataPathError, match="not a .bin/.idx pair"):
        resolve_sources(str(tmp_path / "nope"))
    with pytest.raises(DataPathError, match=r"data\.weights.*3 numbers"):
        resolve_sources(parts, weights=[1, 2])
    with pytest.raises(DataPathError, match="not both"):
        resolve_sources([1, parts[0]], weights=[1])
