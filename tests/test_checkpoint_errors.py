"""Bad or mismatched checkpoints are refused before anything is read, with errors naming the file, the
tensor and both shapes; the trainer is left untouched."""

import os
import shutil

import pytest
from dist_harness import run_on_ranks

DATA_FILE = "__0_0.distcp"


def _break_copies(path: str, root: str) -> dict[str, str]:
    def copy(name: str) -> str:
        target = os.path.join(root, name)
        shutil.copytree(path, target)
        return target

    broken = {"missing_file": copy("missing_file"), "truncated": copy("truncated"), "no_metadata": copy("no_metadata")}
    os.remove(os.path.join(broken["missing_file"], DATA_FILE))
    data = os.path.join(broken["truncated"], DATA_FILE)
    os.truncate(data, os.path.getsize(data) // 2)
    os.remove(os.path.join(broken["no_metadata"], ".metadata"))
    broken["not_a_checkpoint"] = os.path.join(root, "empty")
    os.makedirs(broken["not_a_checkpoint"])
    return broken


def _try_loads(root: str) -> dict:
    import torch
    from checkpoint_helpers import make_trainer, run_steps

    from megacann.checkpoint import CheckpointError

    writer = make_trainer([], f"{root}/run")
    run_steps(writer, 1)
    path = writer.save_checkpoint()
    attempts = {name: ([], p) for name, p in _break_copies(path, root).items()}
    attempts["other_ffn"] = (["model.ffn_hidden_size=96"], path)
    attempts["more_layers"] = (["model.num_layers=6"], path)
    attempts["fewer_layers"] = (["model.num_layers=2"], path)
    messages = {}
    for name, (overrides, target) in attempts.items():
        trainer = make_trainer(overrides, f"{root}/{name}_run")
        before = [p.detach().clone() for p in trainer.params]
        try:
            trainer.load_checkpoint(target)
            messages[name] = None
        except CheckpointError as err:
            messages[name] = str(err)
        untouched = trainer.state.step == 0 and all(torch.equal(a, p) for a, p in zip(before, trainer.params))
        messages[name + "/untouched"] = untouched
    return messages


@pytest.fixture(scope="module")
def messages(tmp_path_factory):
    return run_on_ranks(_try_loads, 1, args=(str(tmp_path_factory.mktemp("errors")),), timeout=200)[0]


EXPECTED = {
    "missing_file": [f"file {DATA_FILE} is missing", "it holds tensor '"],
    "truncated": [f"file {DATA_FILE} is truncated", "tensor '", "needs bytes up to", "the file has"],
    "no_metadata": [".metadata is missing"],
    "not_a_checkpoint": ["not a megacann checkpoint", "megacann.json is missing"],
    "other_ffn": [
        "tensor 'model/layers.0.mlp.gate_up_proj.weight' has shape [256, 64] in the checkpoint, "
        "the model expects [192, 64]",
        "tensor 'model/layers.0.mlp.down_proj.weight' has shape [64, 128] in the checkpoint, "
        "the model expects [64, 96]",
        "more",  # the optimizer's tensors are refused too
    ],
    "more_layers": ["tensor 'model/layers.4.mlp.down_proj.weight' is missing (the model expects shape [64, 128])"],
    "fewer_layers": ["the model has no parameter for", "model/layers.2."],
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_checkpoint_is_refused_with_a_clear_error(messages, case):
    message = messages[case]
    assert message is not None, f"{case}: loading did not fail"
    for fragment in EXPECTED[case]:
        assert fragment in message, f"{case}: {fragment!r} not in:\n{message}"
    assert messages[case + "/untouched"], f"{case}: the trainer changed before the error"
