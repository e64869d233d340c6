"""A rank that hangs in the middle of a step (pipeline stage 1 of 2 stops answering): the watchdog on every
rank reports where each waits, with a Python stack dump, and exits with its own code long before the
one-minute collective timeout, naming the rank that is not in a collective."""

import os
import re

from dist_harness import RankFailure, run_on_ranks

HANG = ["training.hang_factor=3", "training.hang_min_seconds=2", "distributed.timeout_minutes=1"]


def _hang_in_stage_one(out: str) -> None:
    import time

    import torch.distributed as dist
    from training_helpers import synthetic_data_factory, tiny_config

    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    overrides = ["distributed.pipeline_parallel_size=2", f"experiment.output_dir={out}", "optim.max_steps=50"]
    cfg = tiny_config(overrides + HANG + ["logging.log_interval=100"], world_size=dist.get_world_size())
    trainer = Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))
    step = trainer.train_step

    def hanging_step():
        if dist.get_rank() == 1 and trainer.state.step == 4:
            time.sleep(600)  # the hang: this rank never reaches its next send
        return step()

    trainer.train_step = hanging_step
    trainer.fit()


def test_watchdog_reports_every_rank_and_exits_naming_the_hung_one(tmp_path, capfd):
    out = tmp_path / "run"
    try:
        run_on_ranks(_hang_in_stage_one, 2, args=(str(out),), timeout=120)
        raise AssertionError("the run did not stop")
    except RankFailure as failure:
        # the watchdog's exit code on both ranks, not a collective timeout
        assert "exited without a result {0: 3, 1: 3}" in str(failure), failure
    reports = {rank: (out / "hang_reports" / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    first = {rank: text.splitlines()[0] for rank, text in reports.items()}
    assert first[0].startswith("rank 0 (pipeline stage 0/2, tensor rank 0/1, data rank 0/1): step 5 has run ")
    assert "over its limit of 2 s" in first[0] and "collective timeout 60 s" in first[0]
    assert re.search(r"waiting for a peer in megacann/pipeline/p2p\.py:\d+ \(exchange\)$", first[0]) or (
        "waiting in torch.distributed" in first[0]
    ), first[0]
    assert first[1].startswith("rank 1 (pipeline stage 1/2") and "not in a collective: running " in first[1]
    assert f"{os.sep}test_reliability_hang.py:" in first[1] and "(hanging_step)" in first[1]
    for text in reports.values():
        assert "Python stacks of every thread:" in text and 'File "' in text  # faulthandler's dump
        assert "suspects: rank(s) [1] not in a collective (the others wait for them); waiting: [0]" in text
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert f"megacann watchdog: rank {rank} exits with code 3 (hang in step 5)" in err
