"""GRPO step throughput: megacann's ``train_mode: grpo`` against TRL's ``GRPOTrainer``, in one run.

Both train the same tiny random LlamaForCausalLM (written by transformers, loaded by megacann through
``model.init_from``), with the same byte-level tokenizer (one ``tokenizer.json`` for both), the same
string-reversal prompts with an exact-match reward, the same group size, prompts per step, sampling
(temperature 1) and most new tokens, the same clipped-ratio loss (token mean, clip 0.2 / 0.28, no KL) and
the same number of threads. A step is one optimizer step: generate ``group x prompts`` responses, score
them, train on them. The first ``--warmup`` steps of each are left out of the timing; megacann's step time
is its trainer's own (``step_time`` in metrics.jsonl: rollout included), TRL's the time between two
``on_step_end`` callbacks. Each run is a process of its own; ``--rounds`` alternate them (megacann, TRL,
then TRL, megacann ...) so that both meet the same machine load, and the medians of the pooled step times
give the steps/s. The ratio is printed, never asserted.

    python benchmarks/grpo_vs_trl.py                      # d64 x 2 layers, 4 prompts x 8, 8 new tokens, 2 threads
    python benchmarks/grpo_vs_trl.py --steps 20 --hidden 128 --threads 1

TRL is not a dependency of megacann: install it first (``pip install trl``); it is imported only here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_common import add_int_args  # noqa: E402
from megacann.rl.rewards import exact_match  # noqa: E402

RESULT = "RESULT "  # the line a child run prints its step times on


def write_model_and_prompts(args, workdir: str) -> tuple[str, str]:
    """A byte-level tokenizer and a random LlamaForCausalLM saved together in ``workdir/model``, and the
    prompts JSONL (``{"prompt", "answer"}``: reverse a word of 3 to 5 letters); returns both paths."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megacann.data.tokenizer import train_bpe

    model_dir = os.path.join(workdir, "model")
    tokenizer = train_bpe([string.ascii_lowercase], 258, model_dir)  # 256 bytes + EOS + pad, no merges
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=64,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    rng = random.Random(args.seed)
    prompts_path = os.path.join(workdir, "prompts.jsonl")
    with open(prompts_path, "w") as f:
        for _ in range(args.prompts):
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 5)))
            f.write(json.dumps({"prompt": f"Reverse: {word}\n", "answer": word[::-1]}) + "\n")
    return model_dir, prompts_path


def megacann_step_times(args, model_dir: str, prompts_path: str, workdir: str) -> tuple[list[float], float]:
    """megacann's per-step times (after warm-up) and mean response length, from a GRPO run of the trainer
    in this process."""
    import yaml

    from megacann.cli import train_main

    out = os.path.join(workdir, "megacann")
    recipe = {
        "experiment": {"name": "grpo_vs_trl", "output_dir": out},
        "train_mode": "grpo",
        "model": {
            "type": "llama",
            "precision": "fp32",
            "hidden_size": args.hidden,
            "num_layers": args.layers,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.heads,
            "ffn_hidden_size": args.ffn,
            "max_position_embeddings": 64,
            "init_from": model_dir,
        },
        "data": {
            "tokenizer": model_dir,
            "prompt_template": "plain",
            "seq_length": 16 + args.max_new_tokens,
            "batch_size": args.group * args.prompts_per_step,
            "num_workers": 0,
        },
        "optim": {
            "name": "adamw",
            "lr": 1e-5,
            "weight_decay": 0.0,
            "scheduler": "constant",
            "clip_grad": 1.0,
            "max_steps": args.warmup + args.steps,
        },
        "logging": {"log_interval": 1, "ckpt_interval": 0},
        "rl": {
            "prompts": prompts_path,
            "group_size": args.group,
            "max_new_tokens": args.max_new_tokens,
            "temperature": 1.0,
            "reward": "exact_match",
            "clip_low": 0.2,
            "clip_high": 0.28,
            "loss_aggregation": "token_mean",
            "kl_coef": 0.0,
        },
        "seed": args.seed,
    }
    path = os.path.join(workdir, "megacann.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(recipe, f)
    if train_main(["--config", path]) != 0:
        raise SystemExit("grpo_vs_trl: megacann's run failed (above)")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "step_time" in r and r["step"] > args.warmup]
    return [r["step_time"] for r in records], statistics.mean(r["response_length_mean"] for r in records)


def trl_step_times(args, model_dir: str, prompts_path: str, workdir: str) -> tuple[list[float], float]:
    """TRL GRPOTrainer's per-step times (after warm-up) and mean response length, same settings."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    with open(prompts_path) as f:
        dataset = Dataset.from_list([json.loads(line) for line in f])

    def reversal_reward(prompts, completions, answer, **kwargs) -> list[float]:
        return [exact_match(p, c, {"answer": a}) for p, c, a in zip(prompts, completions, answer)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_train_begin(self, *unused, **kwargs):
            self.ends.append(time.perf_counter())

        def on_step_end(self, *unused, **kwargs):
            self.ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=os.path.join(workdir, "trl"),
        per_device_train_batch_size=args.group * args.prompts_per_step,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",  # the token mean over the batch: megacann's loss_aggregation token_mean
        scale_rewards="group",
        max_steps=args.warmup + args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        seed=args.seed,
    )
    clock = StepClock()
    trainer = GRPOTrainer(
        model=LlamaForCausalLM.from_pretrained(model_dir),
        reward_funcs=reversal_reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[clock],
    )
    trainer.train()
    times = [b - a for a, b in zip(clock.ends, clock.ends[1:])][args.warmup :]
    lengths = [r["completions/mean_length"] for r in trainer.state.log_history if "completions/mean_length" in r]
    return times, statistics.mean(lengths[args.warmup :] or lengths)


RUNNERS = {"megacann": megacann_step_times, "trl": trl_step_times}


def run_in_subprocess(name: str, argv: list[str], workdir: str, round_index: int) -> tuple[list[float], float]:
    """One framework's run in a fresh process (no state shared between rounds): its step times and mean length."""
    out = os.path.join(workdir, f"{name}_{round_index}")
    command = [sys.executable, os.path.abspath(__file__), *argv, "--only", name, "--workdir", out]
    proc = subprocess.run(command, capture_output=True, text=True)
    results = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"grpo_vs_trl: the {name} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    times, length = json.loads(results[-1][len(RESULT) :])
    return times, length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_int_args(
        parser,
        hidden=64,
        layers=2,
        heads=4,
        ffn=172,
        group=8,
        prompts_per_step=4,
        max_new_tokens=8,
        prompts=512,
        steps=8,
        warmup=2,
        threads=2,
        rounds=3,
        seed=0,
    )
    parser.add_argument("--only", choices=sorted(RUNNERS), help=argparse.SUPPRESS)  # one run, in a child process
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        torch.set_num_threads(args.threads)
        os.makedirs(args.workdir)
        model_dir, prompts_path = write_model_and_prompts(args, args.workdir)
        print(RESULT + json.dumps(RUNNERS[args.only](args, model_dir, prompts_path, args.workdir)))
        return
    argv = sys.argv[1:]
    pooled: dict[str, list[float]] = {name: [] for name in RUNNERS}
    lengths: dict[str, list[float]] = {name: [] for name in RUNNERS}
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as workdir:
        for round_index in range(args.rounds):  # alternating, so that both meet the same machine load
            order = list(RUNNERS) if round_index % 2 == 0 else list(RUNNERS)[::-1]
            for name in order:
                times, length = run_in_subprocess(name, argv, workdir, round_index)
                pooled[name] += times
                lengths[name].append(length)
                print(f"round {round_index + 1}/{args.rounds} {name}: median step {statistics.median(times):.3f} s")
    print(
        f"\nllama d{args.hidden} x {args.layers} layers, ffn {args.ffn}, {args.prompts_per_step} prompts x "
        f"{args.group} responses a step, <= {args.max_new_tokens} new tokens, {args.threads} threads, "
        f"{args.rounds} alternating rounds of {args.steps} timed steps after {args.warmup}:"
    )
    rates = {}
    for name, times in pooled.items():
        rates[name] = 1.0 / statistics.median(times)
        print(
            f"  {name:9s} {rates[name]:6.2f} steps/s (median step {statistics.median(times) * 1e3:7.1f} ms), "
            f"mean response {statistics.mean(lengths[name]):.1f} tokens"
        )
    print(f"  megacann / trl: {rates['megacann'] / rates['trl']:.2f}x steps/s")


if __name__ == "__main__":
    main()
