"""A checkpoint saved under one layout loads under another, model and optimizer state both resharded: the
weights loaded equal the weights saved bit for bit, and the next steps' losses and weights equal those of the
run that kept its layout (fp32, relative 1e-6 and 1e-5).

Saved under tp2 x pp2 x dp2 with ZeRO-1 (tied embeddings, so the last stage holds a copy of the embedding)
and loaded under tp4 x dp2, pp4 x dp2, interleaved pp2 x vpp2 with ZeRO-2, dp8 with ZeRO-2, and one
process."""

import pytest
import torch
from dist_harness import run_on_ranks

pytestmark = pytest.mark.extended  # a slow check: `make test-extended` runs it

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


def _continue_from(path: str, overrides: list[str], out: str) -> dict:
    """Load ``path`` under ``overrides``: the whole weights right after loading, the next steps' losses and
    the whole weights after them (weights on rank 0 only)."""
    from checkpoint_helpers import make_trainer, run_steps, weights

    trainer = make_trainer(COMMON + overrides, out, STOP + MORE)
    trainer.load_checkpoint(path)
    loaded = weights(trainer)
    losses = [loss for loss, _ in run_steps(trainer, MORE)]
    return {"loaded": loaded, "losses": losses, "final": weights(trainer)}


def _refused(path: str, root: str) -> bool:
    from checkpoint_helpers import make_trainer

    from megacann.checkpoint import CheckpointError

    try:
        make_trainer(COMMON + MISMATCHED, f"{root}/mismatched", STOP + MORE).load_checkpoint(path)
    except CheckpointError:
        return True
    return False


def _origin_and_targets(root: str) -> dict:
    from checkpoint_helpers import make_trainer, run_steps, weights

    trainer = make_trainer(COMMON + ORIGIN, f"{root}/origin", STOP + MORE)
    run_steps(trainer, STOP)
    path = trainer.save_checkpoint()
    saved = weights(trainer)
    kept = {"losses": [loss for loss, _ in run_steps(trainer, MORE)], "final": weights(trainer)}
    got = {name: _continue_from(path, o, f"{root}/{name}") for name, o in TARGETS.items()}
    return {"path": path, "saved": saved, "kept": kept, "got": got, "refused": _refused(path, root)}


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


def _untied(weights: dict) -> dict:
    """The weights without the tied head: a layout whose last stage is not the first holds it as a copy of
    the embedding (checked equal here), one whose stages coincide does not hold it at all."""
    weights = dict(weights)
    head = weights.pop("lm_head.weight", None)
    assert head is None or torch.equal(head, weights["embed_tokens.weight"])
    return weights


def _assert_continues(got: dict, origin: dict, name: str) -> None:
    """The weights loaded equal the weights saved bit for bit; the next steps (which use the resharded
    optimizer moments) give the kept layout's losses and weights within REL."""
    saved, kept = _untied(origin["saved"]), {**origin["kept"], "final": _untied(origin["kept"]["final"])}
    got = {**got, "loaded": _untied(got["loaded"]), "final": _untied(got["final"])}
    assert got["loaded"].keys() == saved.keys(), name
    for key, tensor in saved.items():
        assert torch.equal(got["loaded"][key], tensor), f"{name}: {key} differs right after loading"
    assert len(got["losses"]) == len(kept["losses"]) == MORE, (got["losses"], kept["losses"])
    for step, (a, b) in enumerate(zip(got["losses"], kept["losses"]), start=STOP + 1):
        assert abs(a - b) <= REL * abs(b), f"{name}: step {step} loss {a!r} vs kept layout {b!r}"
    for key, tensor in kept["final"].items():
        err, ref = (got["final"][key] - tensor).norm().item(), tensor.norm().item()
        assert err <= 1e-5 * ref, f"{name}: {key} after {MORE} more steps: ||diff|| {err:.2e} vs ||w|| {ref:.2e}"


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_reshard_to_other_layouts(origin, name):
    _assert_continues(origin[0]["got"][name], origin[0], name)


@pytest.mark.parametrize("name", sorted(TARGETS_WORLD1))
def test_reshard_to_one_process(origin, world1, name):
    _assert_continues(world1[name], origin[0], name)


def test_every_rank_refuses_a_mismatched_model(origin):
    assert all(rank["refused"] for rank in origin)
