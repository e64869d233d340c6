"""FP8 convergence against bf16: a recipe trained once per (precision, seed), final and eval losses compared.

Each run is the recipe (default: the tiny LLaMA of the README) trained in one process with
``model.precision=bf16`` and, for the FP8 rows, ``precision.fp8=<recipe>``: the only difference from the
bf16 row is that the covered linear layers multiply through ``fp8_linear``. The table gives, per recipe,
the mean over seeds of the last logged training loss and the last eval loss, and the largest relative
difference from bf16 of the same seed. CPUs have no FP8 units: this measures numerics, not speed (the
seconds a step are printed only to state the quantisation overhead of the reference implementation).

    python benchmarks/fp8_convergence.py --seeds 1234 1235 1236 --steps 300 --out /tmp/fp8_convergence
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")


def run_once(config: str, steps: int, seed: int, fp8: str, out: str, extra: list[str]) -> dict[str, float]:
    """Train one run (reusing a finished one in ``out``) and read its last losses from metrics.jsonl."""
    metrics = os.path.join(out, "metrics.jsonl")
    if not _finished(metrics, steps):
        overrides = [
            f"optim.max_steps={steps}",
            f"seed={seed}",
            f"experiment.output_dir={out}",
            "logging.ckpt_interval=0",
            "model.precision=bf16",
            f"precision.fp8={fp8}",
            *extra,
        ]
        command = [sys.executable, "-m", "megacann.cli", "--config", config, *overrides]
        if os.path.exists(metrics):
            os.remove(metrics)  # an interrupted run starts again rather than appending to its lines
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return _last_losses(metrics)


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _finished(path: str, steps: int) -> bool:
    return os.path.exists(path) and any(r.get("step") == steps and "loss" in r for r in _records(path))


def _last_losses(path: str) -> dict[str, float]:
    records = _records(path)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    step_times = [r["step_time"] for r in train[1:] if "step_time" in r]
    return {
        "loss": train[-1]["loss"],
        "eval_loss": evals[-1]["eval_loss"] if evals else float("nan"),
        "step_time": sorted(step_times)[len(step_times) // 2] if step_times else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "examples", "configs", "llama", "tiny.yaml"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235, 1236])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--out", default="/tmp/fp8_convergence")
    parser.add_argument("overrides", nargs="*", help="more section.key=value overrides for every run")
    args = parser.parse_args()

    results: dict[str, dict[int, dict[str, float]]] = {}
    for name in ("none", *args.recipes):
        results[name] = {}
        for seed in args.seeds:
            out = os.path.join(args.out, f"{name}_seed{seed}")
            results[name][seed] = run_once(args.config, args.steps, seed, name, out, args.overrides)
            print(f"{name:>10} seed {seed}: {results[name][seed]}", flush=True)

    print(
        f"\n{args.steps} steps of {os.path.relpath(args.config, ROOT)}, seeds {args.seeds}; bf16 = model.precision bf16"
    )
    print("| run | final loss (mean) | eval loss (mean) | max rel. diff final | max rel. diff eval | s/step (median) |")
    print("|---|---|---|---|---|---|")
    base = results["none"]
    for name, runs in results.items():
        mean = {key: sum(r[key] for r in runs.values()) / len(runs) for key in ("loss", "eval_loss", "step_time")}
        diff = {
            key: max(abs(runs[s][key] - base[s][key]) / base[s][key] for s in args.seeds)
            for key in ("loss", "eval_loss")
        }
        label = "bf16" if name == "none" else f"fp8 {name}"
        print(
            f"| {label} | {mean['loss']:.4f} | {mean['eval_loss']:.4f} | {100 * diff['loss']:.2f} % "
            f"| {100 * diff['eval_loss']:.2f} % | {mean['step_time']:.2f} |"
        )


if __name__ == "__main__":
    main()
