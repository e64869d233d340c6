"""The GRPO demonstration's pieces (examples/rl/demo.sh), not its accuracy figure: the task it writes
(string reversal, checkable answers, held-out questions), the scorer of held-out accuracy agreeing with the
reward GRPO trains on, the report's line and table, and the script's usage text."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from cli_helpers import ROOT

from megacann.data.sft_templates import get_template
from megacann.rl.rewards import exact_match as exact_match_reward

EXAMPLES = os.path.join(ROOT, "examples")


def _load_example(relative_path: str):
    """An example script as a module (the examples are not a package)."""
    name = "example_" + relative_path.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, relative_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


evaluate = _load_example("sft/evaluate.py")
report = _load_example("rl/report.py")


def _run(script: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    return proc


def test_the_demo_task_has_checkable_answers_and_held_out_questions(tmp_path):
    """The task as demo.sh writes it (reversal of 3 to 5 letters), through make_prompts: every prompt's answer
    is its word reversed, and no held-out question is a training prompt."""
    task, prompts = tmp_path / "task", tmp_path / "prompts"
    _run(os.path.join(EXAMPLES, "sft", "make_task.py"), "--task", "reverse", "--min_length", "3",
         "--max_length", "5", "--train", "300", "--valid", "10", "--test", "30", "--output", str(task))  # fmt: skip
    _run(os.path.join(EXAMPLES, "rl", "make_prompts.py"), "--task_dir", str(task), "--output", str(prompts))
    splits = {}
    for split, count in (("train", 300), ("valid", 10), ("test", 30)):
        records = [json.loads(line) for line in (prompts / f"{split}.jsonl").read_text().splitlines()]
        assert len(records) == count
        for record in records:
            (message,) = record["messages"]
            verb, word = message["content"].split(": ")
            assert (message["role"], verb) == ("user", "Reverse")
            assert 3 <= len(word) <= 5 and word.isalpha() and word.islower()
            assert record["answer"] == word[::-1]
        splits[split] = {r["messages"][0]["content"] for r in records}
    assert not splits["test"] & splits["train"] and not splits["valid"] & splits["train"]


@pytest.mark.parametrize(
    "prediction, answer, right",
    [("olleh", "olleh", True), (" olleh\n", "olleh", True), ("olleh!", "olleh", False), ("olle", "olleh", False),
     ("", "cba", False), ("hello", "olleh", False)],
)  # fmt: skip
def test_held_out_scorer_agrees_with_the_training_reward(prediction, answer, right):
    """A held-out answer counts as right exactly when GRPO's exact_match reward would pay it 1."""
    assert evaluate.exact_match(prediction, answer, get_template("plain")) is right
    assert exact_match_reward("Reverse: ...", prediction, {"answer": answer}) == float(right)


def _write_seed(folder, correct: dict[str, int], total: int = 300) -> None:
    folder.mkdir(parents=True)
    for run, count in correct.items():
        (folder / f"eval_{run}.json").write_text(json.dumps({"correct": count, "total": total, "accuracy": 0.0}))


def test_report_prints_each_seed_and_the_table(tmp_path, capsys):
    _write_seed(tmp_path / "seed7", {"sft": 108, "grpo": 174, "control": 150})
    _write_seed(tmp_path / "seed-1", {"sft": 90, "grpo": 87, "control": 99}, total=200)
    assert report.main(["--seed_dir", str(tmp_path / "seed7")]) == 0
    assert capsys.readouterr().out == (
        "seed 7: weak SFT 36.0% -> GRPO 58.0% (+22.0 points); SFT control 50.0% (+14.0 points), "
        "on 300 held-out questions\n"
    )
    assert json.loads((tmp_path / "seed7" / "result.json").read_text()) == {
        "seed": 7, "total": 300, "sft": 36.0, "grpo": 58.0, "control": 50.0
    }  # fmt: skip
    assert report.main(["--seed_dir", str(tmp_path / "seed-1")]) == 0
    capsys.readouterr()
    assert report.main(["--table", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "| seed | weak SFT | GRPO | GRPO gain | SFT control | control gain |",
        "|---|---|---|---|---|---|",
        "| -1 | 45.0% | 43.5% | -1.5 | 49.5% | +4.5 |",
        "| 7 | 36.0% | 58.0% | +22.0 | 50.0% | +14.0 |",
    ]


def test_report_names_what_is_missing(tmp_path):
    _write_seed(tmp_path / "seed3", {"sft": 1, "grpo": 2})
    with pytest.raises(SystemExit, match=r"seed3/eval_control\.json not found \(evaluate\.py --output writes it\)"):
        report.main(["--seed_dir", str(tmp_path / "seed3")])
    (tmp_path / "seed3" / "eval_control.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match=r"eval_control\.json: expected an evaluate\.py summary with 'correct'"):
        report.main(["--seed_dir", str(tmp_path / "seed3")])
    with pytest.raises(SystemExit, match=r"report: .*run3: expected a folder named seed<N>"):
        report.main(["--seed_dir", str(tmp_path / "run3")])
    with pytest.raises(SystemExit, match=r"no seed\*/result\.json under .*empty \(run examples/rl/demo\.sh first\)"):
        report.main(["--table", str(tmp_path / "empty")])


def test_demo_script_help_prints_its_usage_and_runs_nothing(tmp_path):
    proc = subprocess.run(
        ["bash", os.path.join(EXAMPLES, "rl", "demo.sh"), "--help"], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "bash examples/rl/demo.sh [OUT_DIR] [SEED]" in proc.stdout
    assert proc.stdout.startswith("# The GRPO demonstration of docs/rl.md")
    assert (
        proc.stdout.splitlines()[-1]
        == "# Run from the repository root with megacann installed (make test fills .venv)."
    )
    assert "set -euo pipefail" not in proc.stdout  # the comment block only
    assert os.listdir(tmp_path) == []
