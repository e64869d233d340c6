"""The learning side of ``benchmarks/grpo_vs_trl.py --learn``: a weak SFT start both libraries share, and
the held-out score of a model.

The task is string reversal (``Reverse: abc`` -> ``cba``, words of 3 to 5 letters) in megacann's SFT format
with the ``plain`` template, so that an SFT sample is ``Reverse: abc\\n`` + ``cba`` + EOS and a GRPO prompt is
exactly the text before the answer. The start is a short megacann SFT run from the benchmark's random
model, written as a Hugging Face directory (``logging.hf_save_interval``): megacann loads it with
``model.init_from``, TRL with ``from_pretrained``. Every model, the start and both libraries' results, is
scored by the same greedy exact-match evaluation (``examples/sft/evaluate.py``: megacann's generator).
"""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVALUATE = os.path.join(ROOT, "examples", "sft", "evaluate.py")


def reversal_questions(count: int, rng: random.Random, exclude: frozenset = frozenset()) -> list[tuple[str, str]]:
    """``count`` distinct (question, answer) pairs of the reversal task whose words are not in ``exclude``."""
    seen: set[str] = set()
    pairs = []
    while len(pairs) < count:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 5)))
        if word in seen or word in exclude:
            continue
        seen.add(word)
        pairs.append((f"Reverse: {word}", word[::-1]))
    return pairs


def write_jsonl(path: str, records: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def write_task(workdir: str, train: int, test: int, seed: int) -> dict[str, str]:
    """The task's files in ``workdir``: ``sft`` (SFT questions), ``prompts`` (the same questions as GRPO
    prompts with answers) and ``test`` (held-out questions, no word shared with training); their paths."""
    rng = random.Random(seed)
    train_pairs = reversal_questions(train, rng)
    test_pairs = reversal_questions(test, rng, exclude=frozenset(a[::-1] for _, a in train_pairs))
    return {
        "sft": write_jsonl(
            os.path.join(workdir, "sft.jsonl"), [{"instruction": q, "output": a} for q, a in train_pairs]
        ),
        "prompts": write_jsonl(
            os.path.join(workdir, "prompts.jsonl"), [{"prompt": q + "\n", "answer": a} for q, a in train_pairs]
        ),
        "test": write_jsonl(
            os.path.join(workdir, "test.jsonl"), [{"instruction": q, "output": a} for q, a in test_pairs]
        ),
    }


def sft_recipe(model: dict, base_dir: str, sft_path: str, steps: int, seed: int, output_dir: str) -> dict:
    """A megacann SFT recipe: ``steps`` steps from ``base_dir`` (64 packed questions a step, constant lr 3e-3,
    as the GRPO demonstration's weak start) whose last step is written as ``<output_dir>/hf_<steps>``."""
    return {
        "experiment": {"name": "grpo_vs_trl_sft", "output_dir": output_dir},
        "train_mode": "sft",
        "model": {**model, "init_from": base_dir},
        "data": {
            "path": sft_path,
            "tokenizer": base_dir,
            "prompt_template": "plain",
            "seq_length": 32,
            "batch_size": 64,
            "num_workers": 0,
        },
        "optim": {"lr": 3e-3, "scheduler": "constant", "warmup_steps": 0, "weight_decay": 0.0, "max_steps": steps},
        "logging": {"log_interval": 50, "ckpt_interval": 0, "eval_interval": 0, "hf_save_interval": steps},
        "seed": seed,
    }


def held_out_accuracy(model_dir: str, tokenizer_dir: str, test_path: str, max_new_tokens: int) -> float:
    """Greedy exact-match accuracy of ``model_dir`` (a Hugging Face directory) on ``test_path``, in a child
    process: megacann's generator, the SFT data path's prompt (``plain`` template)."""
    command = [sys.executable, EVALUATE, "--model", model_dir, "--tokenizer", tokenizer_dir, "--data", test_path]
    command += ["--template", "plain", "--max_new_tokens", str(max_new_tokens)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"grpo_vs_trl: evaluating {model_dir} failed:\n{proc.stderr[-3000:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["accuracy"])


def curve(rewards: list[float], every: int) -> list[float]:
    """Mean reward of each window of ``every`` steps (the last window may be shorter)."""
    return [sum(rewards[i : i + every]) / len(rewards[i : i + every]) for i in range(0, len(rewards), every)]
