"""Loss curve from metrics.jsonl (matplotlib is optional: without it, no plot and a hint)."""

from __future__ import annotations

import json
import os
from typing import Optional


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


def plot_metrics(path: str, output: Optional[str] = None) -> Optional[str]:
    """Plot training (and eval) loss against step; returns the PNG path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("matplotlib is not installed: pip install matplotlib (or megacann[dev]) to plot the loss")
        return None
    records = read_metrics(path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    output = output or os.path.join(os.path.dirname(os.path.abspath(path)), "loss.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(os.path.basename(os.path.dirname(os.path.abspath(path))) or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output
