"""Distributed sampling by consumed samples: disjoint DP ranks, identical TP ranks, exact resume, DP resize."""

import itertools

import numpy as np
import pytest
import torch
from data_fixtures import EOS, FakeTokenizer, make_corpus, random_lengths, tiny_cfg

from megacann.data import build_data_iterators, pretrain_fields
from megacann.data.loader import build_loader
from megacann.data.sampler import ConsumedSamplesSampler

B, SEQ = 2, 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus")
    return make_corpus(path / "c", random_lengths(200, high=60)), path


def iterators(corpus, dp, accum, rank, consumed=0, steps=12, **data):
    prefix, path = corpus
    cfg = tiny_cfg(path, path=prefix, seq_length=SEQ, batch_size=B, dp=dp, accum=accum, max_steps=steps, **data)
    return build_data_iterators(cfg, FakeTokenizer(), consumed_samples=consumed, dp_rank=rank, dp_size=dp)


def rows(batch):
    return [tuple(r) for r in batch["tokens"].tolist()]


def global_steps(corpus, dp, accum, consumed=0, steps=12):
    """Per global step: the rows of every micro-batch of every DP rank, as (rank, micro-step) -> rows."""
    its = [iterators(corpus, dp, accum, r, consumed, steps).train for r in range(dp)]
    out = []
    for _ in range(steps - consumed // (B * dp * accum)):
        out.append({(r, m): rows(next(its[r])) for m in range(accum) for r in range(dp)})
    return out


def test_sampler_slices():
    s = ConsumedSamplesSampler(total_samples=40, consumed_samples=8, micro_batch_size=2, dp_rank=1, dp_size=3)
    assert list(s) == [[10, 11], [16, 17], [22, 23], [28, 29], [34, 35]] and len(s) == 5
    with pytest.raises(ValueError, match="dp_rank 3"):
        ConsumedSamplesSampler(10, 0, 1, 3, 3)


def test_each_step_is_the_next_global_batch_and_ranks_are_disjoint(corpus):
    data = iterators(corpus, 2, 2, 0)
    order = [tuple(pretrain_fields(data.train_dataset[i], EOS)["tokens"]) for i in range(len(data.train_dataset))]
    g = B * 2 * 2
    for k, step in enumerate(global_steps(corpus, 2, 2)):
        for (r, m), got in step.items():
            start = k * g + m * B * 2 + r * B
            assert got == order[start : start + B]
        assert sorted(itertools.chain(*step.values())) == sorted(order[k * g : (k + 1) * g])


def test_batch_layout_and_end_of_run(corpus):
    data = iterators(corpus, 1, 1, 0, steps=3, reset_attention_mask=True)
    batches = list(data.train)
    assert len(batches) == 3
    for batch in batches:
        assert set(batch) == {"tokens", "labels", "position_ids", "segment_ids"}
        assert all(v.shape == (B, SEQ) and v.dtype == torch.int64 for v in batch.values())
        assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])


def test_resume_continues_exactly(corpus):
    full = global_steps(corpus, 2, 2)
    resumed = global_steps(corpus, 2, 2, consumed=5 * B * 2 * 2)
    assert resumed == full[5:]


def test_resume_with_another_dp_size_keeps_the_global_order(corpus):
    full = global_steps(corpus, 2, 2)  # global batch 8 = 2 x dp 2 x accum 2
    wider = global_steps(corpus, 4, 1, consumed=5 * 8)  # global batch 8 = 2 x dp 4 x accum 1
    for before, after in zip(full[5:], wider):
        assert sorted(itertools.chain(*before.values())) == sorted(itertools.chain(*after.values()))
        flat_before = [before[(r, m)] for m in range(2) for r in range(2)]
        flat_after = [after[(r, 0)] for r in range(4)]
        assert flat_before == flat_after  # even the order inside the step is the same


def test_tensor_parallel_ranks_read_the_same_batches_with_or_without_workers(corpus):
    a = iterators(corpus, 2, 1, 1, steps=4)
    b = iterators(corpus, 2, 1, 1, steps=4, num_workers=2, persistent_workers=True)
    for x, y in zip(a.train, b.train):
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_valid_is_fresh_and_identical_each_call(corpus):
    data = iterators(corpus, 1, 2, 0, split="90,10,0")
    first, second = list(data.valid()), list(data.valid())
    assert len(first) == 3 * 2  # eval_iters global batches = eval_iters x accum micro-batches
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(first, second))
    train_rows = {r for i in range(len(data.train_dataset)) for r in [tuple(data.train_dataset[i][:-1])]}
    assert not any(r in train_rows for b in first for r in rows(b))  # held out
    assert iterators(corpus, 1, 1, 0, split="100,0,0").valid() is None


def test_pinned_memory_off_on_cpu(corpus, monkeypatch):
    monkeypatch.setenv("MEGACANN_DEVICE", "cpu")
    assert iterators(corpus, 1, 1, 0, steps=1).train_loader.pin_memory is False


class RandomItems:
    """Items drawn from the worker's NumPy generator: shows how workers are seeded."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": np.random.randint(0, 2**30, size=1)}


def test_workers_are_seeded_from_the_global_seed():
    def draw(seed, rank=0):
        sampler = ConsumedSamplesSampler(8, 0, 2, 0, 1)
        loader = build_loader(RandomItems(), sampler, num_workers=2, seed=seed, dp_rank=rank)
        return [b["x"].tolist() for b in loader]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2) and draw(1) != draw(1, rank=1)


def _rank_batches(prefix, path, steps):
    """On one gloo rank of tp=2 x dp=2: this rank's micro-batches, with dp rank/size from parallel_state."""
    from megacann import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    cfg = tiny_cfg(path, path=prefix, seq_length=SEQ, batch_size=B, dp=dp, accum=1, max_steps=steps)
    data = build_data_iterators(cfg, FakeTokenizer(), dp_rank=dp_rank, dp_size=dp)  # all ranks build the index at once
    return dp_rank, [rows(b) for b in data.train]


@pytest.mark.extended
def test_ranks_of_a_tp2_dp2_grid(tmp_path):
    from dist_harness import run_on_ranks

    prefix = make_corpus(tmp_path / "c", random_lengths(200, high=60))
    results = run_on_ranks(_rank_batches, world_size=4, args=(prefix, tmp_path, 5), timeout=120)
    (dp0, a), (dp1, b), (dp2, c), (dp3, d) = results
    assert (dp0, dp1, dp2, dp3) == (0, 0, 1, 1)  # TP groups [0,1] [2,3]; DP groups [0,2] [1,3]
    assert a == b and c == d  # tensor-parallel peers read identical batches
    assert not set(itertools.chain(*a)) & set(itertools.chain(*c))  # data-parallel ranks are disjoint
