"""Packed pretraining samples: boundaries, EOS placement, model inputs, determinism, epochs, index cache."""

import multiprocessing as mp
import os

import numpy as np
import pytest
from data_fixtures import EOS, doc_tokens, make_corpus, random_lengths

from megacann.data.gpt_dataset import GPTDataset, pretrain_fields, split_ranges
from megacann.data.indexed_dataset import IndexedDataset
from megacann.data.random_order import permutation

S = 8


def dataset(tmp_path, prefix, seed=1, cache="cache", doc_range=None):
    indexed = IndexedDataset(prefix)
    return GPTDataset(indexed, doc_range or (0, len(indexed)), S, seed, EOS, str(tmp_path / cache))


def test_samples_are_the_eos_separated_stream_cut_with_one_token_overlap(tmp_path):
    lengths = random_lengths(30)
    ds = dataset(tmp_path, make_corpus(tmp_path / "c", lengths))
    total = sum(lengths) + len(lengths)  # every document ends with exactly one EOS, added or already there
    assert ds.num_tokens == total and ds.samples_per_epoch == (total - 1) // S
    ds.prepare(ds.samples_per_epoch)
    index = ds.epoch_index(0)
    order = index["doc_order"]
    assert sorted(order.tolist()) == list(range(30))  # each document once per epoch
    stream = np.concatenate([doc_tokens(d, lengths[d]) + [EOS] for d in order])
    for i in range(ds.samples_per_epoch):
        start = int(index["sample_order"][i]) * S
        assert ds[i].tolist() == stream[start : start + S + 1].tolist()
    starts = sorted(int(j) * S for j in index["sample_order"])
    assert starts == list(range(0, ds.samples_per_epoch * S, S))  # consecutive samples share one token


def test_model_inputs_labels_positions_segments():
    sample = np.array([5, 6, EOS, 7, 8, 9, EOS, 10, 11])
    plain = pretrain_fields(sample, EOS)
    assert plain["tokens"].tolist() == [5, 6, EOS, 7, 8, 9, EOS, 10]
    assert plain["labels"].tolist() == [6, EOS, 7, 8, 9, EOS, 10, 11]
    assert plain["position_ids"].tolist() == list(range(8)) and "segment_ids" not in plain
    reset = pretrain_fields(sample, EOS, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    assert reset["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert reset["segment_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 2]  # EOS closes its own document
    assert reset["labels"].tolist() == [6, EOS, -100, 8, 9, EOS, -100, 11]
    assert all(v.dtype == np.int64 for v in reset.values())


def test_same_seed_same_order_other_seed_other_order_and_prefix_stable(tmp_path):
    prefix = make_corpus(tmp_path / "c", random_lengths(40, seed=3))
    a = dataset(tmp_path, prefix, seed=7, cache="a")
    n = 3 * a.samples_per_epoch + 5
    a.prepare(n)
    b = dataset(tmp_path, prefix, seed=7, cache="b").prepare(10)
    c = dataset(tmp_path, prefix, seed=8, cache="c").prepare(n)
    assert all(np.array_equal(a[i], b[i]) for i in range(10))  # a longer run extends a shorter one
    assert not all(np.array_equal(a[i], c[i]) for i in range(10))
    k = a.samples_per_epoch
    epoch0 = sorted(map(tuple, (a[i] for i in range(k))))
    epoch1 = [tuple(a[i]) for i in range(k, 2 * k)]
    assert epoch1 != [tuple(a[i]) for i in range(k)]  # reshuffled per epoch
    assert len(epoch0) == len(epoch1) and n > 3 * k and a[n - 1].shape == (S + 1,)
    with pytest.raises(IndexError):
        a[n]


def test_permutation_is_pinned():
    """The order must not change with NumPy versions or machines: pin a few values."""
    assert permutation(10, 1234, 0, 1).tolist() == permutation(10, 1234, 0, 1).tolist()
    assert sorted(permutation(1000, 5).tolist()) == list(range(1000))
    assert permutation(8, 1234, 0, 1).tolist() == [1, 3, 4, 7, 5, 6, 0, 2]


def test_split_ranges():
    assert split_ranges("98,2,0", 100) == [(0, 98), (98, 100), (100, 100)]
    assert split_ranges("90,10", 7) == [(0, 6), (6, 7), (7, 7)]
    with pytest.raises(ValueError, match="data.split"):
        split_ranges("a,b", 3)


def test_index_is_cached_and_reused(tmp_path, monkeypatch):
    prefix = make_corpus(tmp_path / "c", random_lengths(20))
    first = dataset(tmp_path, prefix).prepare(50)
    expected = [first[i].tolist() for i in range(50)]
    monkeypatch.setattr(GPTDataset, "_build_block", lambda self, e: pytest.fail("index rebuilt"))
    again = dataset(tmp_path, prefix).prepare(50)
    assert [again[i].tolist() for i in range(50)] == expected


def _build_in_process(tmp_path, prefix, queue):
    ds = dataset(tmp_path, prefix, cache="shared").prepare(200)
    queue.put([ds[i].tolist() for i in range(0, 200, 7)])


def test_concurrent_builders_agree(tmp_path):
    prefix = make_corpus(tmp_path / "c", random_lengths(300, high=200))
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_process, args=(tmp_path, prefix, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    assert results[0] == results[1] == results[2]
    leftovers = [f for _, _, files in os.walk(tmp_path / "shared") for f in files if ".tmp" in f]
    assert not leftovers


def test_dataset_smaller_than_a_sample_is_an_error(tmp_path):
    ds = dataset(tmp_path, make_corpus(tmp_path / "c", [3]))
    with pytest.raises(ValueError, match=r"fewer than seq_length \+ 1 = 9"):
        ds.prepare(1)


def test_many_epochs_of_a_small_corpus_make_few_index_files(tmp_path):
    ds = dataset(tmp_path, make_corpus(tmp_path / "c", random_lengths(10)))
    ds.prepare(2000 * ds.samples_per_epoch)
    (cache,) = (tmp_path / "cache" / "index").iterdir()
    assert sorted(d.name for d in cache.iterdir() if d.is_dir()) == ["docs", f"s8-seed1-epochs0+{ds.epochs_per_block}"]
    seen = [tuple(ds[i]) for i in range(1999 * ds.samples_per_epoch, 2000 * ds.samples_per_epoch)]
    assert len(set(seen)) == ds.samples_per_epoch  # the last epoch is still a full permutation


def test_empty_documents_add_nothing_or_just_their_eos(tmp_path):
    ds = dataset(tmp_path, make_corpus(tmp_path / "c", [0, 0, 5]))  # [EOS], [], 5 tokens + EOS
    assert ds.num_tokens == 1 + 0 + 6
