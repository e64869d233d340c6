"""Shared pieces of the reliability tests: a byte-tokenized corpus on disk and a tiny recipe that trains on
it through the console scripts in seconds, and torchrun runs whose ranks can be found and signalled."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml
from cli_helpers import console_script, user_env

from megacann.data.indexed_dataset import write_indexed_dataset
from megacann.data.tokenizer import ByteTokenizer

TEXT = (
    "def add(a, b):\n    return a + b\n\n"
    "class Counter:\n    def __init__(self):\n        self.n = 0\n\n    def tick(self):\n        self.n += 1\n"
)


def write_corpus(directory: Path, documents: int = 64) -> str:
    """A .bin/.idx pair of ``documents`` short byte-tokenized documents (vocabulary 259)."""
    tok = ByteTokenizer()
    docs = [tok.encode(f"# document {i}\n" + TEXT * (1 + i % 3)) + [tok.eos_id] for i in range(documents)]
    return write_indexed_dataset(str(directory / "corpus"), docs, tok.vocab_size)


def write_recipe(directory: Path, corpus: str, **sections) -> Path:
    """A tiny LLaMA recipe on ``corpus`` (fp32, 2 layers, hidden 32, seq 16) writing into directory/run."""
    recipe = {
        "experiment": {"name": "reliability", "output_dir": str(directory / "run")},
        "model": {
            "type": "llama",
            "precision": "fp32",
            "hidden_size": 32,
            "num_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "ffn_hidden_size": 64,
            "max_position_embeddings": 32,
            "make_vocab_size_divisible_by": 16,
        },
        "data": {"path": corpus, "tokenizer": "byte", "seq_length": 16, "batch_size": 2, "num_workers": 0},
        "optim": {"lr": 3e-3, "warmup_steps": 1, "max_steps": 8, "grad_accum_steps": 1},
        "logging": {"log_interval": 1, "ckpt_interval": 2},
        "seed": 5,
    }
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def losses(output_dir: Path) -> dict[int, float]:
    """step -> loss of every logged training step in ``output_dir``/metrics.jsonl."""
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def run_command(args: list[str], cwd: Path, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=user_env(), timeout=timeout, **kwargs)


def train_command(recipe: Path, *extra: str) -> list[str]:
    return [console_script("megacann-train"), "--config", str(recipe), *extra]


def torchrun_command(recipe: Path, nproc: int, *extra: str, max_restarts: int = 0) -> list[str]:
    """torchrun as a user types it, starting megacann-train's module on ``nproc`` local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "-m",
        "megacann.train",
        "--config",
        str(recipe),
        *extra,
    ]


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of the training processes started (at any depth) under ``launcher_pid``."""
    ranks, todo = {}, [launcher_pid]
    while todo:
        pid = todo.pop()
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        values = dict(item.split(b"=", 1) for item in env if b"=" in item)
        if b"megacann.train" in cmdline and b"torch.distributed.run" not in cmdline and b"RANK" in values:
            ranks[int(values[b"RANK"])] = pid
        todo += children(pid)
    return ranks


def wait_for(predicate, timeout: float, what: str, poll: float = 0.02):
    """Poll until ``predicate()`` is truthy (returns it); fails naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def logged_steps(output_dir: Path) -> int:
    """The last step logged in metrics.jsonl so far (0 when none)."""
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)
