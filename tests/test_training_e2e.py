"""End to end: overfitting a few samples, and the command line writing metrics, checkpoints, plot, config."""

import json
import runpy
import subprocess
import sys

import pytest
from cli_helpers import ROOT, user_env
from dist_harness import run_on_ranks


def _overfit() -> list[float]:
    from training_helpers import SyntheticData, tiny_config

    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    cfg = tiny_config(
        [
            "optim.lr=3e-3",
            "optim.max_steps=200",
            "optim.warmup_steps=10",
            "optim.weight_decay=0.0",
            "optim.scheduler=constant",
        ],
        data={"batch_size": 8},
        optim={"grad_accum_steps": 1},
    )
    trainer = Trainer(cfg, setup_runtime(cfg), data=SyntheticData(cfg, 0, 1, num_distinct=24))
    return [trainer.train_step()["loss"] for _ in range(cfg.optim.max_steps)]


def test_overfits_a_few_dozen_samples():
    losses = run_on_ranks(_overfit, 1, timeout=300)[0]
    assert losses[0] > 5.0  # ln(200) at the start
    assert min(losses[-10:]) < 0.05, losses[-10:]


def _cli(args, env=None, cwd=None):
    return subprocess.run(args, capture_output=True, text=True, env=user_env(env), cwd=cwd or ROOT, timeout=600)


@pytest.mark.extended
def test_run_pretrain_script_on_two_ranks_writes_everything(tmp_path):
    """The launcher under torchrun (dp 2): metrics.jsonl, config.yaml, checkpoints, latest, loss plot."""
    out = tmp_path / "run"
    proc = _cli(
        [
            "bash",
            "scripts/run_pretrain.sh",
            "--config",
            "examples/configs/llama/tiny.yaml",
            "--nproc_per_node",
            "2",
            f"experiment.output_dir={out}",
            "optim.max_steps=6",
            "logging.log_interval=2",
            "logging.ckpt_interval=3",
            "logging.eval_interval=3",
            "logging.eval_iters=1",
            "data.batch_size=2",
            "data.num_workers=0",
            "model.num_layers=2",
        ],
        env={"PYTHON": sys.executable, "MEGACANN_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 4, 6]
    for key in ("loss", "grad_norm", "lr", "tokens_per_second", "rss_peak_gib", "step_time"):
        assert key in steps[0], key
    assert "mfu" not in steps[0]  # CPU peak is unknown: MFU omitted, never invented
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    assert (out / "config.yaml").read_text().count("world_size: 2") == 1
    assert (out / "latest").read_text().strip() == "checkpoint_6"
    assert sorted(p.name for p in out.glob("checkpoint_*")) == ["checkpoint_3", "checkpoint_6"]
    assert (out / "loss.png").stat().st_size > 1000
    assert "first loss" in proc.stdout and "last loss" in proc.stdout


def test_bad_override_fails_before_training(monkeypatch, capsys):
    """``python -m megacann.train`` run in-process as ``__main__`` (a fresh interpreter would only add
    torch's import; the extended run_pretrain test starts real processes)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(
        sys, "argv", ["megacann.train", "--config", "examples/configs/llama/tiny.yaml", "optim.lr=fast"]
    )
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("megacann.train", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 2
    assert "optim.lr: expected float (or null), got 'fast'" in capsys.readouterr().err
