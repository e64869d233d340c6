"""Resharding a 3-D checkpoint: saved under tp2 x pp2 x dp2 (ZeRO-1 once available; tied embeddings, so the
last stage holds a copy of the embedding), then loaded under tp4 x dp2, pp4 x dp2, interleaved pp2 x vpp2 and
one process; the next losses equal those of the run that kept its layout (fp32, relative 1e-6)."""

import pytest
from checkpoint_helpers import FEATURES
from dist_harness import run_on_ranks
from test_checkpoint_reshard import COMMON, MORE, STOP, _assert_close, _continue_from

HAS_ZERO = FEATURES["zero"]
pytestmark = pytest.mark.skipif(not FEATURES["pipeline"], reason="needs pipeline parallelism (issue 6)")

ZERO1 = ["distributed.zero_optimization=1"] if HAS_ZERO else []
ORIGIN = ["distributed.tensor_parallel_size=2", "distributed.pipeline_parallel_size=2", "optim.grad_accum_steps=2"]
TARGETS_WORLD8 = {
    "tp4_dp2": ["distributed.tensor_parallel_size=4", "optim.grad_accum_steps=2"],
    "pp4_dp2": ["distributed.pipeline_parallel_size=4", "optim.grad_accum_steps=2"],
    "tp2_pp2_vpp2_dp2": [
        "distributed.tensor_parallel_size=2",
        "distributed.pipeline_parallel_size=2",
        "distributed.virtual_pipeline_size=2",
        "optim.grad_accum_steps=2",
    ]
    + (["distributed.zero_optimization=2"] if HAS_ZERO else []),
}
TARGETS_WORLD1 = {"tp1_pp1_dp1": ["optim.grad_accum_steps=4"]}


def _origin_and_world8_targets(root: str) -> dict:
    from checkpoint_helpers import make_trainer, run_steps

    trainer = make_trainer(COMMON + ORIGIN + ZERO1, f"{root}/origin", STOP + MORE)
    run_steps(trainer, STOP)
    path = trainer.save_checkpoint()
    kept = [loss for loss, _ in run_steps(trainer, MORE)]
    got = {name: _continue_from(path, o, f"{root}/{name}") for name, o in TARGETS_WORLD8.items()}
    return {"path": path, "kept": kept, "got": got}


def _world1_targets(path: str, root: str) -> dict:
    return {name: _continue_from(path, o, f"{root}/{name}") for name, o in TARGETS_WORLD1.items()}


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard3d"))
    return run_on_ranks(_origin_and_world8_targets, 8, args=(root,), timeout=600)[0]


@pytest.fixture(scope="module")
def world1(origin, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard3d1"))
    return run_on_ranks(_world1_targets, 1, args=(origin["path"], root), timeout=300)[0]


@pytest.mark.parametrize("name", sorted(TARGETS_WORLD8))
def test_reshard_3d_to_world8_layouts(origin, name):
    _assert_close(origin["got"][name], origin["kept"], name)


@pytest.mark.parametrize("name", sorted(TARGETS_WORLD1))
def test_reshard_3d_to_one_process(origin, world1, name):
    _assert_close(world1[name], origin["kept"], name)
