#!/usr/bin/env python3
"""The GRPO demonstration's results: one line per seed, and the table over seeds.

    python examples/rl/report.py --seed_dir output/rl_demo/seed1234     # writes result.json, prints the line
    python examples/rl/report.py --table output/rl_demo                  # a Markdown table of every seed<N>/

``--seed_dir`` reads the summaries that ``examples/sft/evaluate.py --output`` wrote there for the weak SFT
model (``eval_sft.json``), GRPO from it (``eval_grpo.json``) and the SFT control (``eval_control.json``),
writes ``result.json`` and prints the held-out accuracies with the change from the weak start in
percentage points. ``--table`` gathers the ``result.json`` of every ``seed<N>/`` folder under a demo's
output directory.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

RUNS = ("sft", "grpo", "control")


def read_summary(path: str) -> dict:
    """An evaluate.py summary, checked to hold ``correct`` and ``total``."""
    try:
        with open(path) as f:
            summary = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"report: {path} not found (evaluate.py --output writes it)") from None
    if not isinstance(summary, dict) or not {"correct", "total"} <= set(summary):
        raise SystemExit(f"report: {path}: expected an evaluate.py summary with 'correct' and 'total'")
    return summary


def seed_result(seed_dir: str) -> dict:
    """``{"seed", "total", "sft", "grpo", "control"}``: the three accuracies (percent) of one seed's runs."""
    match = re.fullmatch(r"seed(-?\d+)", os.path.basename(os.path.normpath(seed_dir)))
    if match is None:
        raise SystemExit(f"report: {seed_dir}: expected a folder named seed<N>")
    result: dict = {"seed": int(match.group(1))}
    for run in RUNS:
        summary = read_summary(os.path.join(seed_dir, f"eval_{run}.json"))
        result["total"] = summary["total"]
        result[run] = 100.0 * summary["correct"] / summary["total"] if summary["total"] else 0.0
    return result


def result_line(result: dict) -> str:
    """``seed S: weak SFT a% -> GRPO b% (+x points); SFT control c% (+y points), on N held-out questions``."""
    return (
        f"seed {result['seed']}: weak SFT {result['sft']:.1f}% -> GRPO {result['grpo']:.1f}% "
        f"({result['grpo'] - result['sft']:+.1f} points); SFT control {result['control']:.1f}% "
        f"({result['control'] - result['sft']:+.1f} points), on {result['total']} held-out questions"
    )


def results_table(results: list[dict]) -> str:
    """A Markdown table, one row per seed (held-out exact match, percent)."""
    lines = [
        "| seed | weak SFT | GRPO | GRPO gain | SFT control | control gain |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: r["seed"]):
        lines.append(
            f"| {r['seed']} | {r['sft']:.1f}% | {r['grpo']:.1f}% | {r['grpo'] - r['sft']:+.1f} | "
            f"{r['control']:.1f}% | {r['control'] - r['sft']:+.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--seed_dir", help="one seed's folder: write result.json, print its line")
    which.add_argument("--table", help="a demo's output folder: the table of its seed<N>/result.json")
    args = parser.parse_args(argv)
    if args.seed_dir:
        result = seed_result(args.seed_dir)
        with open(os.path.join(args.seed_dir, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(result_line(result))
        return 0
    paths = sorted(glob.glob(os.path.join(args.table, "seed*", "result.json")))
    if not paths:
        raise SystemExit(f"report: no seed*/result.json under {args.table} (run examples/rl/demo.sh first)")
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    print(results_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
