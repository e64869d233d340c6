"""The command line resumes by itself when output_dir holds a complete checkpoint, and says so."""

import json
import sys

import pytest
from test_training_e2e import _cli

TINY = [
    "examples/configs/llama/tiny.yaml",
    "logging.log_interval=1",
    "logging.ckpt_interval=2",
    "logging.keep_last=1",
    "logging.eval_interval=0",
    "data.batch_size=2",
    "data.num_workers=0",
    "model.num_layers=2",
]


@pytest.mark.extended
def test_second_launch_resumes_automatically(tmp_path):
    out = tmp_path / "run"
    first = _cli(
        [sys.executable, "-m", "megacann.train", "--config", *TINY, f"experiment.output_dir={out}", "optim.max_steps=2"]
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"no checkpoint in {out}: starting from step 0" in first.stdout
    second = _cli(
        [sys.executable, "-m", "megacann.train", "--config", *TINY, f"experiment.output_dir={out}", "optim.max_steps=4"]
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming from {out}/checkpoint_2 (automatically: output_dir holds a complete checkpoint)" in second.stdout
    assert f"loaded {out}/checkpoint_2 (step 2, " in second.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [1, 2, 3, 4]  # the second run continued at step 3
    assert sorted(p.name for p in out.glob("checkpoint_*")) == ["checkpoint_4"]  # keep_last 1
    info = json.loads((out / "checkpoint_4" / "megacann.json").read_text())
    assert info["step"] == 4 and info["consumed_samples"] == 4 * 2 * info["layout"]["data_parallel_size"]
