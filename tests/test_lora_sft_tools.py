"""The SFT demonstration tools: ``examples/sft/make_task.py`` writes distinct, correct, held-out questions
reproducibly; ``examples/sft/evaluate.py`` generates what transformers' greedy ``generate`` (KV cache)
generates, with and without a PEFT adapter, and counts exact matches right on known answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megacann.config import ModelConfig
from megacann.data.sft import parse_record, tokenize_conversation
from megacann.data.sft_templates import get_template
from megacann.data.tokenizer import ByteTokenizer
from megacann.interop.hf import save_pretrained_hf
from megacann.interop.peft import save_peft_adapter
from megacann.layers import init_normal, initialize_weights, parameter_seed
from megacann.layers.lora import LoRAConfig, attach_lora, lora_parameters
from megacann.layers.sharding import init_sharded_
from megacann.models import LlamaModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT = os.path.join(ROOT, "examples", "sft")


def _run(script: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, os.path.join(SFT, script), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    if ok:
        assert done.returncode == 0, done.stderr
    return done


def _read(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("task,extra", [("add", ["--digits", "2"]), ("reverse", ["--max_length", "5"])])
def test_make_task_writes_distinct_correct_held_out_questions(tmp_path, task, extra):
    args = ["--task", task, "--train", "60", "--valid", "10", "--test", "20", "--seed", "4", *extra]
    _run("make_task.py", *args, "--output", str(tmp_path / "a"))
    splits = {s: _read(tmp_path / "a" / f"{s}.jsonl") for s in ("train", "valid", "test")}
    assert {s: len(r) for s, r in splits.items()} == {"train": 60, "valid": 10, "test": 20}
    questions = [r["instruction"] for rows in splits.values() for r in rows]
    assert len(set(questions)) == 90  # every question distinct: valid and test are held out
    for record in (r for rows in splits.values() for r in rows):
        parse_record(record)  # megacann's SFT format
        kind, _, body = record["instruction"].partition(": ")
        if task == "add":
            a, b = body.split(" + ")
            assert kind == "Add" and int(record["output"]) == int(a) + int(b) and max(int(a), int(b)) < 100
        else:
            assert kind == "Reverse" and record["output"] == body[::-1] and 3 <= len(body) <= 5
    summary = json.loads((tmp_path / "a" / "task.json").read_text())
    assert summary["counts"] == {"train": 60, "valid": 10, "test": 20} and summary["settings"]["task"] == task

    _run("make_task.py", *args, "--output", str(tmp_path / "b"))  # same seed: same files
    _run("make_task.py", *args, "--train", "80", "--output", str(tmp_path / "c"))  # more training data
    for split in ("train", "valid", "test"):
        assert (tmp_path / "a" / f"{split}.jsonl").read_bytes() == (tmp_path / "b" / f"{split}.jsonl").read_bytes()
    assert _read(tmp_path / "c" / "test.jsonl") == splits["test"]  # held-out questions stay put


def test_make_task_refuses_a_task_too_small_for_the_request(tmp_path):
    done = _run("make_task.py", "--digits", "1", "--output", str(tmp_path), ok=False)
    assert done.returncode != 0
    assert "has only 100; ask for at most 50 or widen the task" in done.stderr


QUESTIONS = ["Add: 1 + 2", "Add: 12 + 345", "Reverse: abc", "Add: 7 + 70", "Reverse: hello there"]
MAX_NEW = 6


def _tiny_byte_llama(tmp_path) -> tuple[str, str]:
    """A random LLaMA over byte tokens exported as a Hugging Face directory, and a random PEFT adapter."""
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=259)
    model = LlamaModel(cfg)
    initialize_weights(model, 8)
    save_pretrained_hf([model], str(tmp_path / "base"), model.config)
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    attach_lora(model, lora)
    for name, p in lora_parameters(model):
        init_sharded_(p, init_normal(0.5), 0, 1, parameter_seed(8, name))
    save_peft_adapter([model], str(tmp_path / "adapter"), lora)
    return str(tmp_path / "base"), str(tmp_path / "adapter")


def _transformers_answers(base: str, adapter: str | None) -> list[list[int]]:
    """Greedy answer tokens from transformers' generate (KV cache) on the prompts training would build."""
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(base, attn_implementation="eager")
    if adapter:
        model = pytest.importorskip("peft").PeftModel.from_pretrained(model, adapter)
    model.eval()
    tokenizer, template, answers = ByteTokenizer(), get_template("plain"), []
    for question in QUESTIONS:
        ids, _ = tokenize_conversation(parse_record({"instruction": question, "output": ""})[:-1], template, tokenizer)
        prompt = torch.tensor([ids[:-1].tolist()])
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=256, pad_token_id=258)
        out = out[0, prompt.shape[1] :].tolist()
        answers.append(out[: out.index(256)] if 256 in out else out)
    return answers


@pytest.mark.extended
def test_evaluate_generates_like_transformers_and_counts_exact_matches(tmp_path):
    base, adapter = _tiny_byte_llama(tmp_path)
    references = {adapted: _transformers_answers(base, adapted) for adapted in (None, adapter)}
    assert references[None] != references[adapter]  # the adapter acts
    decode = ByteTokenizer().decode
    for adapted, tokens in references.items():
        expected = [decode(t) for t in tokens]
        right = [0, 2, 3]  # these questions get the model's own answer (padded with spaces) as the reference
        rows = [
            {"instruction": q, "output": f"  {expected[i]} " if i in right else "not what it says"}
            for i, q in enumerate(QUESTIONS)
        ]
        data = tmp_path / "test.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        args = ["--model", base, "--tokenizer", "byte", "--data", str(data), "--template", "plain"]
        args += ["--max_new_tokens", str(MAX_NEW), "--batch_size", "2"]  # batches mix prompt lengths: left padding
        args += ["--predictions", str(tmp_path / "p.jsonl"), "--output", str(tmp_path / "s.json")]
        done = _run("evaluate.py", *args, *(["--adapter", adapted] if adapted else []))
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        assert summary == json.loads((tmp_path / "s.json").read_text())
        assert (summary["correct"], summary["total"], summary["accuracy"]) == (3, 5, 0.6)
        predictions = _read(tmp_path / "p.jsonl")
        assert [p["tokens"] for p in predictions] == tokens, f"adapter={adapted}"
        assert [p["prediction"] for p in predictions] == expected
        assert [p["correct"] for p in predictions] == [i in right for i in range(5)]
        assert [p["question"] for p in predictions] == QUESTIONS
