"""The GRPO recipes and launcher: the real-size recipe's dry run counts the reference copy and the generation
cache (against the formulas, written out here), the tiny recipe's launcher forces train_mode grpo, and the
prompts writer turns a task into chat prompts with answers."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from cli_helpers import ROOT, user_env

from megacann.cli import train_main

GRPO_8B = os.path.join(ROOT, "examples", "configs", "qwen3", "grpo_8b.yaml")


def test_real_size_dry_run_counts_the_reference_and_the_generation_cache(capsys):
    assert train_main(["--config", GRPO_8B, "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "world 8 = tp 4 x pp 1 x dp 2" in out
    # the copy: the policy's bf16 weights on a tp-4 rank (params/device from the same table), 2 bytes each
    row = next(line for line in out.splitlines() if line.startswith("0 "))
    params = int(row.split()[1].replace(",", ""))
    assert (
        f"GRPO reference: a frozen copy of the starting weights, sharded like the policy: {2 * params / 1e9:.1f}" in out
    )
    # keys and values of 36 layers, 4 x 32 rows of 4095 slots (a prompt of 4096 - max_new_tokens, the new
    # tokens but the last), 8 kv heads / tp 4 of 128, bf16
    cache = 2 * 36 * (4 * 32) * 4095 * (8 // 4) * 128 * 2
    assert f"GRPO generation cache: {cache / 1e9:.2f} GB per device (128 rows x 4095 slots" in out
    assert f"({cache:,} bytes in all)" in out
    assert train_main(["--config", GRPO_8B, "--dry_run", "rl.kl_coef=0", "rl.reference=auto"]) == 0
    assert "GRPO reference: none" in capsys.readouterr().out


def test_launcher_forces_train_mode_grpo():
    recipe = "examples/configs/llama/grpo_tiny.yaml"
    proc = subprocess.run(
        ["bash", "scripts/run_grpo.sh", "--config", recipe, "--print_only", "rl.group_size=4"],
        capture_output=True,
        text=True,
        env=user_env(None),
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout.strip().splitlines()[-1])
    assert cmd[cmd.index("-m", 3) :] == [
        "-m",
        "megacann.train",
        "--config",
        recipe,
        "rl.group_size=4",
        "train_mode=grpo",
    ]


def test_make_prompts_turns_a_task_into_chat_prompts_with_answers(tmp_path):
    task = tmp_path / "task"
    task.mkdir()
    (task / "train.jsonl").write_text(json.dumps({"instruction": "Reverse: abc", "output": "cba"}) + "\n")
    script = os.path.join(ROOT, "examples", "rl", "make_prompts.py")
    proc = subprocess.run(
        [sys.executable, script, "--task_dir", str(task), "--output", str(tmp_path / "rl")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "rl" / "train.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"messages": [{"role": "user", "content": "Reverse: abc"}], "answer": "cba"}
    ]
