"""Saves that fail at world 2: a disk that fills up on one rank, and a rank killed in the middle of a save.
Either way the previous checkpoint stays complete, 'latest' and loadable, and nothing is rotated away; the
run resumed from it at world 2 trains on to the end with the loss and gradient-norm trace and the final
weights of the same run never interrupted, bit for bit (the checkpoint it resumes from is complete)."""

import errno
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from dist_harness import RankFailure, run_on_ranks

SETTINGS = ["logging.ckpt_interval=2", "logging.keep_last=1"]


def _fail_second_save_on_rank_one(action) -> None:
    """Run ``action`` inside the second checkpoint's data writing, on rank 1 only."""
    import torch.distributed as dist

    from megacann.checkpoint import checkpointer
    from megacann.checkpoint.planner import PieceSavePlanner

    saves, original_save, original_resolve = [0], checkpointer.Checkpointer.save, PieceSavePlanner.resolve_data

    def counting_save(self, *args, **kwargs):
        saves[0] += 1
        return original_save(self, *args, **kwargs)

    def resolve_data(self, item):
        if saves[0] == 2 and dist.get_rank() == 1:
            action()
        return original_resolve(self, item)

    checkpointer.Checkpointer.save = counting_save
    PieceSavePlanner.resolve_data = resolve_data


def _traced(trainer):
    """``trainer`` with every step's (loss, grad_norm) appended to ``trainer.trace``, fit() included."""
    trainer.trace, step = [], trainer.train_step

    def traced_step():
        metrics = step()
        trainer.trace.append((metrics["loss"], metrics["grad_norm"]))
        return metrics

    trainer.train_step = traced_step
    return trainer


def _fit_to_the_end(root: str, name: str, resume: bool) -> tuple:
    """Train run ``name`` to step 6 (from its latest checkpoint with ``resume``): the step it started from,
    its trace, and on rank 0 its whole final weights."""
    from checkpoint_helpers import make_trainer, weights

    trainer = _traced(make_trainer(SETTINGS, f"{root}/{name}", max_steps=6))
    if resume:
        trainer.resume("latest")
    start = trainer.state.step
    trainer.fit()
    return start, trainer.trace, weights(trainer)


def _full_disk_then_killed(root: str) -> None:
    import torch.distributed as dist
    from checkpoint_helpers import make_trainer

    from megacann.checkpoint import CheckpointError

    def no_space():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    _, trace, final = _fit_to_the_end(root, "uninterrupted", resume=False)
    if dist.get_rank() == 0:
        torch.save({"trace": trace, "weights": final}, f"{root}/uninterrupted.pt")
    _fail_second_save_on_rank_one(no_space)
    trainer = _traced(make_trainer(SETTINGS, f"{root}/full", max_steps=6))
    with pytest.raises(CheckpointError) as failed:
        trainer.fit()
    outcome = {
        "message": str(failed.value),
        "step": trainer.state.step,
        "listing": sorted(os.listdir(f"{root}/full")),
        "trace": trainer.trace,
    }
    with open(f"{root}/full_rank{dist.get_rank()}.json", "w") as f:
        json.dump(outcome, f)

    _fail_second_save_on_rank_one(lambda: os.kill(os.getpid(), signal.SIGKILL))
    make_trainer(SETTINGS, f"{root}/killed", max_steps=6).fit()


def _resume_both(root: str) -> dict:
    from checkpoint_helpers import make_trainer

    found = {}
    for name in ("full", "killed"):
        trainer = make_trainer(SETTINGS, f"{root}/{name}", max_steps=6)
        trainer.resume("latest")
        found[name] = (trainer.state.step, trainer.train_step()["loss"], sorted(os.listdir(f"{root}/{name}")))
    return found


def _resume_both_at_world2(root: str) -> dict:
    return {name: _fit_to_the_end(root, name, resume=True) for name in ("full", "killed")}


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("saves"))
    with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] exited without a result|failed on rank 0"):
        run_on_ranks(_full_disk_then_killed, 2, args=(root,), timeout=240)
    full = [json.loads(Path(f"{root}/full_rank{rank}.json").read_text()) for rank in (0, 1)]
    resumed = run_on_ranks(_resume_both, 1, args=(root,), timeout=240)[0]  # before the world-2 runs save on
    return full, resumed, run_on_ranks(_resume_both_at_world2, 2, args=(root,), timeout=240)[0], root


def _assert_resumed_as_uninterrupted(root: str, resumed: tuple) -> None:
    """Steps 3-6 of the run resumed from checkpoint_2 at world 2: the uninterrupted run's losses and gradient
    norms and its final weights (every tensor), bit for bit."""
    start, trace, final = resumed
    uninterrupted = torch.load(f"{root}/uninterrupted.pt")
    assert start == 2 and len(uninterrupted["trace"]) == 6
    assert trace == uninterrupted["trace"][2:], (trace, uninterrupted["trace"])
    assert final.keys() == uninterrupted["weights"].keys()
    for name, tensor in uninterrupted["weights"].items():
        assert torch.equal(final[name], tensor), name


def test_a_full_disk_on_one_rank_fails_the_save_on_both_and_keeps_the_previous_checkpoint(saves):
    full, resumed, at_world2, root = saves
    for rank in full:
        assert rank["step"] == 4
        message = rank["message"]
        assert message.startswith(f"saving {os.path.dirname(message.split(' ')[1])}/checkpoint_4 failed: ")
        assert "OSError: [Errno 28] No space left on device" in message
        assert "the previous checkpoint " in message and "checkpoint_2 is intact and still 'latest'" in message
        assert "nothing was deleted (logging.keep_last rotates only after a complete save)" in message
        assert [n for n in rank["listing"] if n.startswith("checkpoint")] == ["checkpoint_2"]  # no .tmp left
    step, loss, listing = resumed["full"]
    assert step == 2 and loss == loss and "checkpoint_2" in listing  # loads at world 1, trains on
    # the failed run trained the uninterrupted run's steps 1-4 (the same run up to its failed save)
    assert [tuple(t) for t in full[0]["trace"]] == torch.load(f"{root}/uninterrupted.pt")["trace"][:4]
    _assert_resumed_as_uninterrupted(root, at_world2["full"])


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(saves):
    _, resumed, at_world2, root = saves
    step, loss, listing = resumed["killed"]
    assert step == 2 and loss == loss  # the latest complete checkpoint, loaded at world 1 from world 2
    assert "checkpoint_2" in listing and "checkpoint_4" not in listing
    _assert_resumed_as_uninterrupted(root, at_world2["killed"])
