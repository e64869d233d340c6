"""GRPO step throughput: megacann's ``train_mode: grpo`` against TRL's ``GRPOTrainer``, in one run; with
``--learn``, both learning the same task from the same start.

Both train the same tiny LlamaForCausalLM (written by transformers, loaded by megacann through
``model.init_from``), with the same byte-level tokenizer (one ``tokenizer.json`` for both), the same
string-reversal prompts with an exact-match reward, the same group size, prompts per step, sampling
(temperature 1, nothing cut) and most new tokens, the same precision (``--precision``, fp32 unless asked:
TRL's GRPOConfig turns bf16 autocast on by default, so it is set explicitly), the same clipped-ratio loss (token mean: TRL's
``loss_type: dapo``; clip 0.2 / 0.28; no KL: TRL's ``beta`` 0), the same advantages (group mean, divided by
the group's std: ``scale_rewards: group``), one update per rollout (TRL's ``num_iterations`` 1, megacann's
``ppo_epochs`` 1), the same AdamW (lr ``--lr``, betas 0.9 / 0.999: TRL's defaults, megacann's beta2 set to
them; no weight decay, no warm-up, constant lr, gradient clip 1) and the same number of threads. A step is
one optimizer step: generate ``group x prompts`` responses, score them, train on them. The first
``--warmup`` steps of each are left out of the timing; megacann's step time is its trainer's own
(``step_time`` in metrics.jsonl: rollout included), TRL's the time between two ``on_step_end`` callbacks.
Each run is a process of its own; ``--rounds`` alternate them (megacann, TRL, then TRL, megacann ...) so
that both meet the same machine load, and the medians of the pooled step times give the steps/s. The
ratio is printed, never asserted.

Without ``--learn`` the model is random (its reward stays 0: the benchmark times the work of a step). With
``--learn`` it is first trained ``--sft-steps`` steps of megacann SFT on the task (:mod:`grpo_learning`),
both libraries start from that Hugging Face directory, and the report adds each run's mean reward per
``--curve-every`` steps and the held-out greedy accuracy (``--test`` questions) before and after.

    python benchmarks/grpo_vs_trl.py                      # d64 x 2 layers, 4 prompts x 8, 8 new tokens, 2 threads
    python benchmarks/grpo_vs_trl.py --steps 20 --hidden 128 --threads 1
    python benchmarks/grpo_vs_trl.py --learn --prompts-per-step 8 --steps 78 --rounds 1 --prompts 3000

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
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_common import add_int_args  # noqa: E402
from benchmarks.grpo_learning import curve, held_out_accuracy, reversal_questions, sft_recipe, write_jsonl, write_task  # noqa: E402
from megacann.rl.rewards import exact_match  # noqa: E402

RESULT = "RESULT "  # the line a child run prints its step times on


def write_model(args, model_dir: str) -> None:
    """A byte-level tokenizer and a random LlamaForCausalLM (``args``' sizes), saved together in ``model_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megacann.data.tokenizer import train_bpe

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


def write_random_prompts(args, workdir: str) -> str:
    """``args.prompts`` reversal prompts (``{"prompt", "answer"}``) in ``workdir/prompts.jsonl``; its path."""
    rng = random.Random(args.seed)
    return write_jsonl(
        os.path.join(workdir, "prompts.jsonl"),
        [{"prompt": q + "\n", "answer": a} for q, a in reversal_questions(args.prompts, rng)],
    )


def megacann_model_keys(args) -> dict:
    """The recipe's ``model`` section for the benchmark's LLaMA (its weights come from ``init_from``)."""
    return {
        "type": "llama",
        "precision": args.precision,
        "hidden_size": args.hidden,
        "num_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads,
        "ffn_hidden_size": args.ffn,
        "max_position_embeddings": 64,
    }


def run_recipe(recipe: dict, path: str) -> None:
    """Write ``recipe`` to ``path`` and train it with megacann in this process."""
    import yaml

    from megacann.cli import train_main

    with open(path, "w") as f:
        yaml.safe_dump(recipe, f)
    if train_main(["--config", path]) != 0:
        raise SystemExit(f"grpo_vs_trl: megacann's run of {path} failed (above)")


def prepare(args, workdir: str) -> dict[str, str]:
    """What both libraries start from, made once: ``model`` (a Hugging Face directory with the tokenizer) and
    ``prompts``; with ``--learn`` also ``test`` (held-out questions) and ``tokenizer``. The model is the random
    one, or with ``--learn`` that one after ``--sft-steps`` steps of megacann SFT on the task."""
    base = os.path.join(workdir, "base")
    write_model(args, base)
    if not args.learn:
        return {"model": base, "prompts": write_random_prompts(args, workdir), "tokenizer": base}
    task = write_task(workdir, args.prompts, args.test, args.seed)
    out = args.sft_dir or os.path.join(workdir, "sft")
    start = {"model": os.path.join(out, f"hf_{args.sft_steps}"), "prompts": task["prompts"], "test": task["test"]}
    if os.path.isdir(start["model"]):  # kept from an earlier run with --sft-dir (the same seed: the same task)
        return {**start, "tokenizer": base}
    recipe = sft_recipe(megacann_model_keys(args), base, task["sft"], args.sft_steps, args.seed, out)
    command = [sys.executable, os.path.abspath(__file__), "--sft-recipe", json.dumps(recipe), "--workdir", workdir]
    threads = {"OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **threads})
    if proc.returncode != 0:
        raise SystemExit(f"grpo_vs_trl: the SFT start failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {**start, "tokenizer": base}


def megacann_run(args, start: dict[str, str], workdir: str) -> dict:
    """A GRPO run of megacann's trainer in this process: see :func:`run_result`."""
    out = os.path.join(workdir, "megacann")
    total = args.warmup + args.steps
    recipe = {
        "experiment": {"name": "grpo_vs_trl", "output_dir": out},
        "train_mode": "grpo",
        "model": {**megacann_model_keys(args), "init_from": start["model"]},
        "data": {
            "tokenizer": start["tokenizer"],
            "prompt_template": "plain",
            "seq_length": 16 + args.max_new_tokens,
            "batch_size": args.group * args.prompts_per_step,
            "num_workers": 0,
        },
        "optim": {
            "name": "adamw",
            "lr": args.lr,
            "adam_beta2": 0.999,  # TRL's (transformers') default; megacann's own is 0.95
            "weight_decay": 0.0,
            "scheduler": "constant",
            "warmup_steps": 0,
            "clip_grad": 1.0,
            "max_steps": total,
        },
        "logging": {"log_interval": 1, "ckpt_interval": 0, "hf_save_interval": total if args.learn else 0},
        "rl": {
            "prompts": start["prompts"],
            "group_size": args.group,
            "max_new_tokens": args.max_new_tokens,
            "temperature": 1.0,
            "reward": "exact_match",
            "scale_rewards": "group",
            "clip_low": 0.2,
            "clip_high": 0.28,
            "loss_aggregation": "token_mean",
            "kl_coef": 0.0,
        },
        "seed": args.seed,
    }
    run_recipe(recipe, os.path.join(workdir, "megacann.yaml"))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "step_time" in r]
    return run_result(
        args,
        [r["step_time"] for r in records],
        [r["response_length_mean"] for r in records],
        [r["reward_mean"] for r in records],
        os.path.join(out, f"hf_{total}") if args.learn else None,
    )


def trl_run(args, start: dict[str, str], workdir: str) -> dict:
    """A run of TRL's GRPOTrainer with the same settings: see :func:`run_result`."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    with open(start["prompts"]) as f:
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
        learning_rate=args.lr,
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
        bf16=args.precision == "bf16",  # TRL's own default is bf16 autocast: the same precision as megacann's
        dataloader_num_workers=0,
        seed=args.seed,
    )
    clock = StepClock()
    trainer = GRPOTrainer(
        model=LlamaForCausalLM.from_pretrained(start["model"]),
        reward_funcs=reversal_reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(start["tokenizer"]),
        callbacks=[clock],
    )
    trainer.train()
    final = None
    if args.learn:
        final = os.path.join(workdir, "trl_final")
        trainer.save_model(final)
    logs = [r for r in trainer.state.log_history if "completions/mean_length" in r]
    return run_result(
        args,
        [b - a for a, b in zip(clock.ends, clock.ends[1:])],
        [r["completions/mean_length"] for r in logs],
        [r["reward"] for r in logs],
        final,
    )


def run_result(args, times: list[float], lengths: list[float], rewards: list[float], final: Optional[str]) -> dict:
    """What a child run reports: the step times and mean response length after the warm-up, the mean reward
    of every step, and the trained model's directory (``--learn``; else None)."""
    return {
        "times": times[args.warmup :],
        "length": statistics.mean(lengths[args.warmup :] or lengths),
        "rewards": rewards,
        "final": final,
    }


RUNNERS = {"megacann": megacann_run, "trl": trl_run}


def run_in_subprocess(name: str, argv: list[str], start: dict[str, str], workdir: str) -> dict:
    """One library's run in a fresh process (no state shared between rounds): :func:`run_result`'s dict."""
    command = [sys.executable, os.path.abspath(__file__), *argv, "--only", name, "--workdir", workdir]
    command += ["--start", json.dumps(start)]
    proc = subprocess.run(command, capture_output=True, text=True)
    results = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"grpo_vs_trl: the {name} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(results[-1][len(RESULT) :])


def parse_args() -> argparse.Namespace:
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
        sft_steps=150,
        test=200,
        curve_every=10,
    )
    parser.add_argument("--lr", type=float, help="learning rate of both (default 1e-5, with --learn 3e-4)")
    parser.add_argument(
        "--precision", choices=("fp32", "bf16"), default="fp32", help="both runs' precision (TRL: bf16 autocast)"
    )
    parser.add_argument("--learn", action="store_true", help="start both from a weak SFT model of the task")
    parser.add_argument("--sft-dir", help="with --learn: where the SFT start is made, or reused if already there")
    parser.add_argument("--only", choices=sorted(RUNNERS), help=argparse.SUPPRESS)  # one run, in a child process
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--start", help=argparse.SUPPRESS)  # the child's start (JSON of prepare's dict)
    parser.add_argument("--sft-recipe", help=argparse.SUPPRESS)  # the SFT start's recipe, run in a child
    args = parser.parse_args()
    if args.lr is None:
        args.lr = 3e-4 if args.learn else 1e-5
    return args


def report(args, results: dict[str, list[dict]], start: dict[str, str], load: tuple[float, float]) -> None:
    """The summary: steps/s from the pooled step times, and with ``--learn`` the reward curves and held-out
    accuracies."""
    print(
        f"\nllama d{args.hidden} x {args.layers} layers, ffn {args.ffn}, {args.prompts_per_step} prompts x "
        f"{args.group} responses a step, <= {args.max_new_tokens} new tokens, {args.precision}, lr {args.lr:g}, "
        f"{args.threads} threads, "
        f"{args.rounds} alternating rounds of {args.steps} timed steps after {args.warmup}; "
        f"load average {load[0]:.1f} -> {load[1]:.1f}:"
    )
    rates = {}
    for name, runs in results.items():
        times = [t for run in runs for t in run["times"]]
        rates[name] = 1.0 / statistics.median(times)
        print(
            f"  {name:9s} {rates[name]:6.2f} steps/s (median step {statistics.median(times) * 1e3:7.1f} ms), "
            f"mean response {statistics.mean(run['length'] for run in runs):.1f} tokens"
        )
    print(f"  megacann / trl: {rates['megacann'] / rates['trl']:.2f}x steps/s")
    if not args.learn:
        return
    before = held_out_accuracy(start["model"], start["tokenizer"], start["test"], args.max_new_tokens)
    print(f"\nheld-out greedy accuracy of the SFT start ({args.sft_steps} steps): {before:.1%}")
    print(f"mean reward per {args.curve_every} steps, then held-out accuracy after {args.warmup + args.steps} steps:")
    for name, runs in results.items():
        for i, run in enumerate(runs):
            after = held_out_accuracy(run["final"], start["tokenizer"], start["test"], args.max_new_tokens)
            points = " ".join(f"{x:.2f}" for x in curve(run["rewards"], args.curve_every))
            print(f"  {name:9s} round {i + 1}: {points} | {before:.1%} -> {after:.1%} ({(after - before) * 100:+.1f})")


def main() -> None:
    args = parse_args()
    if args.sft_recipe:  # the SFT start, in a child process of its own
        torch.set_num_threads(args.threads)
        run_recipe(json.loads(args.sft_recipe), os.path.join(args.workdir, "sft.yaml"))
        return
    if args.only:
        torch.set_num_threads(args.threads)
        os.makedirs(args.workdir)
        print(RESULT + json.dumps(RUNNERS[args.only](args, json.loads(args.start), args.workdir)))
        return
    argv = sys.argv[1:]
    results: dict[str, list[dict]] = {name: [] for name in RUNNERS}
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as workdir:
        start = prepare(args, workdir)
        load_start = os.getloadavg()[0]
        for round_index in range(args.rounds):  # alternating, so that both meet the same machine load
            order = list(RUNNERS) if round_index % 2 == 0 else list(RUNNERS)[::-1]
            for name in order:
                run = run_in_subprocess(name, argv, start, os.path.join(workdir, f"{name}_{round_index}"))
                results[name].append(run)
                print(
                    f"round {round_index + 1}/{args.rounds} {name}: median step {statistics.median(run['times']):.3f} s"
                )
        report(args, results, start, (load_start, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
