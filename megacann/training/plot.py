"""Plots of metrics.jsonl: one PNG with loss (raw and smoothed), eval loss, learning rate, grad norm and
tokens/s panels, one or several runs overlaid under their names. matplotlib is optional: without it, no
plot and a hint."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

# (metrics key, panel title, y label)
PANELS = (
    ("loss", "training loss", "loss"),
    ("eval_loss", "eval loss", "loss"),
    ("lr", "learning rate", "lr"),
    ("grad_norm", "grad norm (before clipping)", "norm"),
    ("tokens_per_second", "throughput", "tokens/s"),
)
# runs of train_mode grpo (their records hold reward_mean): what the rollouts earn and how they change
RL_PANELS = (
    ("loss", "training loss", "loss"),
    ("reward_mean", "reward (mean over the rollouts)", "reward"),
    ("response_length_mean", "response length (mean)", "tokens"),
    ("kl", "KL to the reference", "kl"),
    ("entropy", "entropy at response tokens", "nats"),
)


@dataclass
class Run:
    """One run's records under the name its curves carry."""

    name: str
    records: list[dict[str, Any]]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` over the records that hold a finite number for it."""
        pairs = [
            (r["step"], float(r[key]))
            for r in self.records
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
        ]
        return [p[0] for p in pairs], [p[1] for p in pairs]


def read_metrics(path: str) -> list[dict]:
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON object: {err}") from None
    return records


def metrics_path(path: str) -> str:
    """A metrics.jsonl file, or the run folder holding one."""
    candidate = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(candidate):
        raise FileNotFoundError(f"{path}: no metrics.jsonl here (give a run's output_dir or its metrics.jsonl)")
    return candidate


def run_names(paths: Sequence[str]) -> list[str]:
    """Each run's folder name; the folder's parent is added where two runs would share a name."""
    dirs = [os.path.dirname(os.path.abspath(metrics_path(p))) for p in paths]
    names = [os.path.basename(d) for d in dirs]
    return [
        os.path.join(os.path.basename(os.path.dirname(d)), n) if names.count(n) > 1 else n for d, n in zip(dirs, names)
    ]


def smooth(values: Sequence[float], weight: float = 0.6) -> list[float]:
    """Exponential moving average with bias correction (TensorBoard's smoothing): the first points are
    not pulled towards zero. ``weight`` 0 returns the values unchanged."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out, average = [], 0.0
    for i, value in enumerate(values):
        average = weight * average + (1.0 - weight) * value
        out.append(average / (1.0 - weight ** (i + 1)))
    return out


def build_figure(runs: Sequence[Run], smoothing: float = 0.6):
    """The figure: a 2 x 3 grid of the PANELS (RL_PANELS when a run holds rewards), each run in its own
    colour on every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, grid = plt.subplots(2, 3, figsize=(15, 8))
    axes = list(grid.flat)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    rl = any(run.series("reward_mean")[0] for run in runs)
    for ax, (key, title, ylabel) in zip(axes, RL_PANELS if rl else PANELS):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        drawn = False
        for i, run in enumerate(runs):
            steps, values = run.series(key)
            if not steps:
                continue
            drawn, color = True, colors[i % len(colors)]
            if key == "loss":
                ax.plot(steps, values, color=color, alpha=0.3, linewidth=1, label=f"{run.name} (raw)")
                ax.plot(steps, smooth(values, smoothing), color=color, linewidth=2, label=f"{run.name} (smoothed)")
            elif key == "eval_loss":
                ax.plot(steps, values, "o-", color=color, label=run.name)
            else:
                ax.plot(steps, values, color=color, label=run.name)
        if not drawn:
            ax.text(0.5, 0.5, f"no {key} in these runs", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.legend(fontsize="small")
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        if key == "tokens_per_second":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        if key == "grad_norm":
            low, high = ax.get_ylim()
            if low > 0 and high / low > 100:
                ax.set_yscale("log")
    axes[-1].axis("off")
    axes[-1].text(
        0.0,
        0.9,
        "\n".join(f"{run.name}: {len(run.series('loss')[0])} logged steps" for run in runs)
        + f"\nsmoothing: EMA weight {smoothing:g}",
        va="top",
        transform=axes[-1].transAxes,
    )
    fig.tight_layout()
    return fig


def plot_runs(
    paths: Sequence[str], output: str, names: Optional[Sequence[str]] = None, smoothing: float = 0.6
) -> Optional[str]:
    """Plot several runs' metrics.jsonl (or run folders) into one PNG; returns its path, or None without
    matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except Exception:
        print("matplotlib is not installed: pip install matplotlib (or megacann[dev]) to plot the metrics")
        return None
    if names is not None and len(names) != len(paths):
        raise ValueError(f"{len(names)} names for {len(paths)} runs: give one name per run")
    names = list(names) if names is not None else run_names(paths)
    runs = [Run(name, read_metrics(metrics_path(p))) for name, p in zip(names, paths)]
    import matplotlib.pyplot as plt

    fig = build_figure(runs, smoothing)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output


def plot_metrics(path: str, output: Optional[str] = None) -> Optional[str]:
    """One run's plot, by default ``loss.png`` beside its metrics.jsonl (what a training run writes)."""
    output = output or os.path.join(os.path.dirname(os.path.abspath(metrics_path(path))), "loss.png")
    return plot_runs([path], output)
