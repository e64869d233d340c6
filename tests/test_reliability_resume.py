"""Resuming with another data-parallel size: a run saved at step 2 by 2 data-parallel ranks (global batch 4)
resumed on 1 rank (global batch 2) must find data for its remaining steps, continuing the global sample order
where the 2 ranks stopped (before the fix the order was sized max_steps x the new global batch, already
consumed: StopIteration)."""

import pytest
import torch
from data_fixtures import FakeTokenizer, make_corpus, random_lengths, tiny_cfg

from megacann.data import build_data_iterators


def test_resume_on_fewer_ranks_continues_the_global_order(tmp_path):
    prefix = make_corpus(tmp_path / "corpus", random_lengths(300))
    cfg = tiny_cfg(tmp_path, path=prefix, batch_size=2, dp=1, max_steps=4)  # after resuming on one rank
    consumed = 2 * (2 * 2)  # steps 1-2 at micro-batch 2 x dp 2
    resumed = build_data_iterators(cfg, FakeTokenizer(), consumed_samples=consumed, remaining_steps=2)
    got = [next(resumed.train)["tokens"] for _ in range(2)]
    with pytest.raises(StopIteration):  # exactly the remaining steps' samples
        next(resumed.train)

    fresh = build_data_iterators(cfg, FakeTokenizer(), remaining_steps=6)  # one rank from the start
    order = [next(fresh.train)["tokens"] for _ in range(6)]
    assert all(torch.equal(a, b) for a, b in zip(got, order[4:6]))  # samples 8-11 of the global order

    stale = build_data_iterators(cfg, FakeTokenizer(), consumed_samples=consumed)  # sized as before the fix
    with pytest.raises(StopIteration):
        next(stale.train)
