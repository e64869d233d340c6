"""scripts/plot_loss.py: several runs' metrics.jsonl into one PNG with the five panels, runs under their names."""

import json
import math
import os
import runpy
import subprocess
import sys

import pytest

from megacann.training.plot import Run, build_figure, run_names, smooth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_run(folder, lr_scale: float, with_eval: bool = True) -> str:
    os.makedirs(folder)
    path = os.path.join(folder, "metrics.jsonl")
    with open(path, "w") as f:
        for step in [1, *range(10, 101, 10)]:
            record = {
                "step": step,
                "loss": 9.0 * math.exp(-step / 40) + 2.0 + 0.1 * (step % 20 == 0),
                "grad_norm": 1.0 / step,
                "lr": lr_scale * min(1.0, step / 20),
                "tokens_per_second": 1000.0 + step,
                "step_time": 0.5,
            }
            f.write(json.dumps(record) + "\n")
            if with_eval and step % 50 == 0:
                f.write(json.dumps({"step": step, "eval_loss": record["loss"] + 0.3, "eval_ppl": 1.0}) + "\n")
    return path


def test_smoothing_is_a_bias_corrected_moving_average():
    assert smooth([4.0, 4.0, 4.0], 0.9) == pytest.approx([4.0, 4.0, 4.0])  # no pull towards zero
    assert smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, (0.25 + 1.5) / 0.75])
    assert smooth([1.0, 5.0, 2.0], 0.0) == [1.0, 5.0, 2.0]
    with pytest.raises(ValueError, match="smoothing weight must be in"):
        smooth([1.0], 1.0)


def test_panels_overlay_runs_under_their_names(tmp_path):
    pytest.importorskip("matplotlib")
    a = _write_run(tmp_path / "a" / "baseline", 3e-4)
    b = _write_run(tmp_path / "b" / "baseline", 1e-3, with_eval=False)
    assert run_names([a, str(tmp_path / "b" / "baseline")]) == ["a/baseline", "b/baseline"]
    from megacann.training.plot import read_metrics

    runs = [Run("slow", read_metrics(a)), Run("fast", read_metrics(b))]
    fig = build_figure(runs, smoothing=0.6)
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert list(panels) == ["training loss", "eval loss", "learning rate", "grad norm (before clipping)", "throughput"]
    loss = panels["training loss"]
    lines = {line.get_label(): line for line in loss.get_lines()}
    assert list(lines) == ["slow (raw)", "slow (smoothed)", "fast (raw)", "fast (smoothed)"]
    steps, values = runs[0].series("loss")
    assert list(lines["slow (raw)"].get_xdata()) == steps and list(lines["slow (raw)"].get_ydata()) == values
    assert list(lines["slow (smoothed)"].get_ydata()) == pytest.approx(smooth(values, 0.6))
    assert [line.get_label() for line in panels["eval loss"].get_lines()] == ["slow"]  # only one run evaluated
    assert list(panels["learning rate"].get_lines()[1].get_ydata())[-1] == pytest.approx(1e-3)
    assert all(ax.get_xlabel() == "step" for ax in panels.values())
    assert panels["throughput"].get_ylabel() == "tokens/s"


def test_a_grpo_run_gets_the_reward_length_kl_and_entropy_panels():
    pytest.importorskip("matplotlib")
    records = [
        {
            "step": s,
            "loss": 0.1,
            "reward_mean": 0.1 * s,
            "response_length_mean": 9.0 - s,
            "kl": 0.01 * s,
            "entropy": 2.0,
        }
        for s in (1, 2, 3)
    ]
    fig = build_figure([Run("grpo", records)], smoothing=0.6)
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert list(panels)[1:] == [
        "reward (mean over the rollouts)",
        "response length (mean)",
        "KL to the reference",
        "entropy at response tokens",
    ]
    reward = panels["reward (mean over the rollouts)"].get_lines()[0]
    assert list(reward.get_xdata()) == [1, 2, 3] and list(reward.get_ydata()) == pytest.approx([0.1, 0.2, 0.3])


def test_script_writes_one_png_from_two_runs(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    a = _write_run(tmp_path / "run_a", 3e-4)
    _write_run(tmp_path / "run_b", 1e-3)
    out = tmp_path / "compare.png"
    script = os.path.join(ROOT, "scripts", "plot_loss.py")
    proc = subprocess.run(
        [sys.executable, script, a, str(tmp_path / "run_b"), "--names", "base", "high lr", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (800, 1500)  # 15 x 8 inches at 100 dpi


def test_script_names_a_folder_without_metrics(tmp_path, monkeypatch, capsys):
    """The script's error path, run in-process as ``__main__`` (the test above starts it as a user does)."""
    script = os.path.join(ROOT, "scripts", "plot_loss.py")
    monkeypatch.setattr(sys, "argv", [script, str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(script, run_name="__main__")
    assert exit_.value.code == 2 and "no metrics.jsonl here" in capsys.readouterr().err
