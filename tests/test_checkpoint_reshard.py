"""A checkpoint saved under one layout loads under another, model and optimizer state both resharded: the
next steps' losses equal those of the run that kept its layout (fp32, relative 1e-6).

Saved under tp2 x pp2 x dp2 with ZeRO-1 (tied embeddings, so the last stage holds a copy of the embedding)
and loaded under tp4 x dp2, pp4 x dp2, interleaved pp2 x vpp2 with ZeRO-2, dp8 with ZeRO-2, and one
process."""

import pytest
from dist_harness import run_on_ranks

STOP, MORE = 3, 2
REL = 1e-6
# no dropout (masks differ between layouts); tied embeddings; the global batch stays 8 in every layout
COMMON = ["model.hidden_dropout=0.0", "model.attention_dropout=0.0", "model.tie_word_embeddings=true"]
TP2, PP2 = "distributed.tensor_parallel_size=2", "distributed.pipeline_parallel_size=2"
ZERO2 = "distributed.zero_optimization=2"
WORLD = 8
ORIGIN = [TP2, PP2, "optim.grad_accum_steps=2", "distributed.zero_optimization=1"]
TARGETS = {
    "tp4_dp2": ["distributed.tensor_parallel_size=4", "optim.grad_accum_steps=2"],
    "pp4_dp2": ["distributed.pipeline_parallel_size=4", "optim.grad_accum_steps=2"],
    "tp2_pp2_vpp2_dp2_zero2": [TP2, PP2, "distributed.virtual_pipeline_size=2", "optim.grad_accum_steps=2", ZERO2],
    "dp8_zero2": ["data.batch_size=1", "optim.grad_accum_steps=1", ZERO2],
}
# stage 1 lacks layers 4 and 5, stage 0 finds nothing wrong: every rank must still refuse
MISMATCHED = [TP2, PP2, "optim.grad_accum_steps=2", "model.num_layers=6"]
TARGETS_WORLD1 = {"tp1_pp1_dp1": ["optim.grad_accum_steps=4"]}


def _continue_from(path: str, overrides: list[str], out: str) -> list[float]:
    from checkpoint_helpers import make_trainer, run_steps

    trainer = make_trainer(COMMON + overrides, out, STOP + MORE)
    trainer.load_checkpoint(path)
    return [loss for loss, _ in run_steps(trainer, MORE)]


def _refused(path: str, root: str) -> bool:
    from checkpoint_helpers import make_trainer

    from megacann.checkpoint import CheckpointError

    try:
        make_trainer(COMMON + MISMATCHED, f"{root}/mismatched", STOP + MORE).load_checkpoint(path)
    except CheckpointError:
        return True
    return False


def _origin_and_targets(root: str) -> dict:
    from checkpoint_helpers import make_trainer, run_steps

    trainer = make_trainer(COMMON + ORIGIN, f"{root}/origin", STOP + MORE)
    run_steps(trainer, STOP)
    path = trainer.save_checkpoint()
    kept = [loss for loss, _ in run_steps(trainer, MORE)]
    got = {name: _continue_from(path, o, f"{root}/{name}") for name, o in TARGETS.items()}
    return {"path": path, "kept": kept, "got": got, "refused": _refused(path, root)}


def _world1_targets(path: str, root: str) -> dict:
    return {name: _continue_from(path, o, f"{root}/{name}") for name, o in TARGETS_WORLD1.items()}


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    return run_on_ranks(_origin_and_targets, WORLD, args=(root,), timeout=600)


@pytest.fixture(scope="module")
def world1(origin, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard1"))
    return run_on_ranks(_world1_targets, 1, args=(origin[0]["path"], root), timeout=300)[0]


def _assert_close(got: list[float], kept: list[float], name: str) -> None:
    assert len(got) == len(kept), f"{name}: {len(got)} steps vs {len(kept)} in the kept layout"
    for step, (a, b) in enumerate(zip(got, kept), start=STOP + 1):
        assert abs(a - b) <= REL * abs(b), f"{name}: step {step} loss {a!r} vs kept layout {b!r}"


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_reshard_to_other_layouts(origin, name):
    _assert_close(origin[0]["got"][name], origin[0]["kept"], name)


@pytest.mark.parametrize("name", sorted(TARGETS_WORLD1))
def test_reshard_to_one_process(origin, world1, name):
    _assert_close(world1[name], origin[0]["kept"], name)


def test_every_rank_refuses_a_mismatched_model(origin):
    assert all(rank["refused"] for rank in origin)
