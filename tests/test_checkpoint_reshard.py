"""A checkpoint saved under one layout loads under another, model and optimizer state both resharded: the
next steps' losses equal those of the run that kept its layout (fp32, relative 1e-6)."""

import pytest
from dist_harness import run_on_ranks

STOP, MORE = 3, 2
# no dropout (masks differ between layouts); tied embeddings; the global batch stays 8 in every layout
COMMON = ["model.hidden_dropout=0.0", "model.attention_dropout=0.0", "model.tie_word_embeddings=true"]
ORIGIN = ["distributed.tensor_parallel_size=2", "optim.grad_accum_steps=2"]  # tp2 x dp2 on 4 ranks
TARGETS_WORLD4 = {
    "tp4": ["distributed.tensor_parallel_size=4", "optim.grad_accum_steps=4"],
    "dp4": ["optim.grad_accum_steps=1"],
}
TARGETS_WORLD1 = {"tp1": ["optim.grad_accum_steps=4"]}
REL = 1e-6


def _continue_from(path: str, overrides: list[str], out: str) -> list[float]:
    from checkpoint_helpers import make_trainer, run_steps

    trainer = make_trainer(COMMON + overrides, out, STOP + MORE)
    trainer.load_checkpoint(path)
    return [loss for loss, _ in run_steps(trainer, MORE)]


def _origin_and_world4_targets(root: str) -> dict:
    from checkpoint_helpers import make_trainer, run_steps

    trainer = make_trainer(COMMON + ORIGIN, f"{root}/origin", STOP + MORE)
    run_steps(trainer, STOP)
    path = trainer.save_checkpoint()
    kept = [loss for loss, _ in run_steps(trainer, MORE)]
    got = {name: _continue_from(path, o, f"{root}/{name}") for name, o in TARGETS_WORLD4.items()}
    return {"path": path, "kept": kept, "got": got}


def _world1_targets(path: str, root: str) -> dict:
    return {name: _continue_from(path, o, f"{root}/{name}") for name, o in TARGETS_WORLD1.items()}


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    return run_on_ranks(_origin_and_world4_targets, 4, args=(str(tmp_path_factory.mktemp("reshard")),), timeout=400)[0]


@pytest.fixture(scope="module")
def world1(origin, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard1"))
    return run_on_ranks(_world1_targets, 1, args=(origin["path"], root), timeout=300)[0]


def _assert_close(got: list[float], kept: list[float], name: str) -> None:
    for step, (a, b) in enumerate(zip(got, kept), start=STOP + 1):
        assert abs(a - b) <= REL * abs(b), f"{name}: step {step} loss {a!r} vs kept layout {b!r}"


@pytest.mark.parametrize("name", sorted(TARGETS_WORLD4))
def test_reshard_tp2_dp2_to_world4_layouts(origin, name):
    _assert_close(origin["got"][name], origin["kept"], name)


@pytest.mark.parametrize("name", sorted(TARGETS_WORLD1))
def test_reshard_tp2_dp2_to_one_process(origin, world1, name):
    _assert_close(world1[name], origin["kept"], name)
