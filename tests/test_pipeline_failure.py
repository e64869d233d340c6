"""A rank that fails ends every rank promptly, with the failing rank named, instead of a hang."""

import time

import pytest
from dist_harness import RankFailure, run_on_ranks

TIMEOUT_MINUTES = 0.2  # 12 s collective timeout; the monitor's grace period is half of it


def _crash_one_stage(failing_rank: int) -> tuple:
    """pp 2 x dp 2: ``failing_rank`` raises inside its stage's forward in the second step."""
    import warnings

    import torch.distributed as dist
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    warnings.simplefilter("ignore")
    overrides = [
        "optim.grad_accum_steps=4",
        "distributed.pipeline_parallel_size=2",
        f"distributed.timeout_minutes={TIMEOUT_MINUTES}",
    ]
    cfg = tiny_config(overrides, world_size=dist.get_world_size())
    runtime = setup_runtime(cfg)
    data = SyntheticData(cfg, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    trainer = Trainer(cfg, runtime, data=data)
    trainer.train_step()
    if dist.get_rank() == failing_rank:
        chunk, calls = trainer.model_chunks[0], [0]
        forward = chunk.forward

        def failing_forward(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected failure in a stage's forward")
            return forward(*args, **kwargs)

        chunk.forward = failing_forward
    try:
        trainer.train_step()
        outcome = ("finished", "")
    except Exception as err:
        outcome = (type(err).__name__, str(err))
    return (*outcome, ps.get_pipeline_model_parallel_rank())


def test_stage_crash_ends_every_rank_naming_the_failing_one():
    failing = 2  # pipeline stage 1 of data-parallel replica 0; ranks 1 and 3 are the other replica
    results = run_on_ranks(_crash_one_stage, 4, args=(failing,), timeout=120)
    kind, message, stage = results[failing]
    assert (kind, stage) == ("RuntimeError", 1) and "injected failure" in message
    # every other rank stops with the failure protocol's error (not a collective timeout), naming the rank
    for rank, (kind, message, _) in enumerate(results):
        if rank != failing:
            assert kind == "PeerFailure", (rank, kind, message)
            assert f"stops: rank {failing} (pipeline stage 1/2, tensor rank 0/1, data rank 0/2) failed" in message
            assert "RuntimeError: injected failure in a stage's forward" in message


def _blocked_behind_a_live_failed_rank() -> None:
    """Rank 1 fails but stays alive; rank 0 waits for a message from it that never comes."""
    import torch
    import torch.distributed as dist

    from megacann.training.failure import failure_guard, start_failure_monitor

    start_failure_monitor(dist.get_rank(), dist.get_world_size(), TIMEOUT_MINUTES)
    if dist.get_rank() == 1:
        try:
            with failure_guard():
                raise ValueError("stage 1 broke")
        except ValueError:
            time.sleep(60)  # keeps its connections open: gloo alone would not wake rank 0 up
    else:
        with failure_guard():
            dist.recv(torch.empty(1), src=1)


@pytest.mark.extended
def test_monitor_ends_a_rank_blocked_behind_a_failed_one():
    # exit code 1 from the monitor (os._exit), no result: a gloo timeout (2 min, beyond the harness's 90 s)
    # would have raised inside the rank and been reported as its error instead
    with pytest.raises(RankFailure, match=r"rank\(s\) \[0\] exited without a result \{0: 1\}"):
        run_on_ranks(_blocked_behind_a_live_failed_rank, 2, timeout=90)
