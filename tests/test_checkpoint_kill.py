"""A process killed in the middle of a save leaves the previous checkpoint intact, and the run resumes from
it with the loss trace of a run that was never killed (bitwise)."""

import multiprocessing as mp
import os
import signal
import time

import pytest
from dist_harness import run_on_ranks

pytestmark = pytest.mark.extended  # a slow check: `make test-extended` runs it

MAX_STEPS = 100  # the schedule of every run here; none goes that far
SETTINGS = ["logging.ckpt_interval=2", "logging.keep_last=1"]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _train_and_kill_self(out: str, phase: str) -> None:
    """Train with checkpoints at steps 2, 4, ...; the save of step 4 is killed at ``phase``."""
    import shutil

    from checkpoint_helpers import make_trainer

    import megacann.checkpoint.checkpointer as checkpointer
    from megacann.checkpoint.planner import PieceSavePlanner

    saves = {"n": 0, "items": 0}
    original_save = checkpointer.Checkpointer.save

    def counting_save(self, *args, **kwargs):
        saves["n"] += 1
        return original_save(self, *args, **kwargs)

    checkpointer.Checkpointer.save = counting_save
    if phase == "writing_data":  # a few tensors of the second checkpoint are in its file
        original = PieceSavePlanner.resolve_data

        def resolve_data(self, item):
            if saves["n"] == 2:
                saves["items"] += 1
                if saves["items"] == 6:
                    _die()
            return original(self, item)

        PieceSavePlanner.resolve_data = resolve_data
    elif phase == "before_publish":  # data files and DCP's .metadata are written, COMPLETE is not
        original_publish = checkpointer.publish
        checkpointer.publish = lambda *a: _die() if saves["n"] == 2 else original_publish(*a)
    elif phase == "rotating":  # the new checkpoint is published, the old one half deleted
        original_rmtree = shutil.rmtree

        def rmtree(path, *a, **k):
            if saves["n"] == 2 and path.endswith(".old"):
                os.remove(os.path.join(path, "megacann.json"))
                _die()
            return original_rmtree(path, *a, **k)

        shutil.rmtree = rmtree
    make_trainer(SETTINGS, out, MAX_STEPS).fit()


def _train_slowly(out: str) -> None:
    """Checkpoint every step, each save slowed down, until the test kills this process."""
    from checkpoint_helpers import make_trainer

    from megacann.checkpoint.planner import PieceSavePlanner

    original = PieceSavePlanner.resolve_data

    def slow(self, item):
        time.sleep(0.02)
        return original(self, item)

    PieceSavePlanner.resolve_data = slow
    make_trainer(["logging.ckpt_interval=1", "logging.keep_last=2"], out, MAX_STEPS).fit()


def _one_process(target, *args) -> None:
    """A one-process world (as megacann-train without torchrun) running ``target(*args)``."""
    import torch

    from megacann.parallel_state import initialize_distributed

    torch.set_num_threads(1)
    os.environ["MEGACANN_DEVICE"] = "cpu"
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    initialize_distributed("gloo")
    target(*args)


def _resume_everywhere(outs: dict, reference_dir: str) -> dict:
    """For each killed run: which checkpoint is found, and the next two steps after resuming; plus the
    trace of a run never killed."""
    from checkpoint_helpers import make_trainer, run_steps

    from megacann.checkpoint import latest_checkpoint

    reference = run_steps(make_trainer(SETTINGS, reference_dir, MAX_STEPS), 8)
    found = {}
    for name, out in outs.items():
        path = latest_checkpoint(out)
        trainer = make_trainer(SETTINGS, out, MAX_STEPS)
        trainer.resume("latest")
        step = trainer.state.step
        found[name] = {"path": path, "step": step, "next": run_steps(trainer, 2), "listing": sorted(os.listdir(out))}
    return {"reference": reference, "found": found}


PHASES = ("writing_data", "before_publish", "rotating")


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    outs = {name: str(root / name) for name in PHASES + ("external",)}
    spawn = mp.get_context("spawn")
    children = {
        phase: spawn.Process(target=_one_process, args=(_train_and_kill_self, outs[phase], phase), daemon=True)
        for phase in PHASES
    }
    # killed from outside, at a moment the test does not choose, while a save is being written
    children["external"] = spawn.Process(target=_one_process, args=(_train_slowly, outs["external"]), daemon=True)
    for child in children.values():  # all at once: their start-up costs overlap
        child.start()
    deadline = time.monotonic() + 120
    target = os.path.join(outs["external"], "checkpoint_3.tmp")
    while not os.path.isdir(target) and time.monotonic() < deadline and children["external"].is_alive():
        time.sleep(0.005)
    time.sleep(0.1)
    os.kill(children["external"].pid, signal.SIGKILL)
    for name, child in children.items():
        child.join(max(1.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
        assert child.exitcode == -signal.SIGKILL, f"{name}: exit code {child.exitcode}"
    return run_on_ranks(_resume_everywhere, 1, args=(outs, str(root / "reference")), timeout=200)[0]


@pytest.mark.parametrize("phase", PHASES + ("external",))
def test_killed_save_leaves_a_resumable_run(killed_runs, phase):
    reference, found = killed_runs["reference"], killed_runs["found"][phase]
    step = found["step"]
    listing = found["listing"]
    if phase == "rotating":  # the new one was published; the old one is out of the complete set
        assert step == 4 and "checkpoint_2.old" in listing and "checkpoint_2" not in listing, found
    elif phase == "external":
        assert step >= 2 and any(name.endswith(".tmp") for name in listing), found  # killed mid-save
    else:
        assert step == 2 and "checkpoint_4.tmp" in listing and "checkpoint_4" not in listing, found
    assert found["path"].endswith(f"checkpoint_{step}")
    assert found["next"] == reference[step : step + 2], f"{phase}: resumed steps differ from the unkilled run"
