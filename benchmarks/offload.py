"""Offload: per-rank memory and step time with and without optimizer and activation offload, same run.

    python benchmarks/offload.py [--dp 1 2] [--steps 3] [--hidden 512 --layers 6 --vocab 32000 --seq 128]

A bf16 LLaMA trained on random tokens by the real Trainer on ``dp`` gloo ranks (ZeRO-1 at dp > 1), in four
variants: no offload, ``optim.offload_optimizer``, ``training.activation_offload_layers`` = all layers, both.
Bytes per rank come from the tensors (``megacann.optimizer.memory``: the device's params / grads / optimizer
state, and what the optimizer keeps in host memory) and from the activation offload's counter (the peak of
host copies alive). On CPU the host is the same memory: the figures say where each byte would live on a
device, and the step time is the price of the copies and the host update on this machine (on an
accelerator the copies use pinned memory and overlap the stream; the CPU update's cost is what remains).
Step time: the fastest of the timed steps after one warm-up (each timed on its slowest rank); the first
variant runs twice and its first pass is dropped (a process's first trainer pays for lazy initialisation).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from bench_common import add_llama_size_args, llama_model, random_token_trainer, timed_steps  # noqa: E402
from dist_harness import run_on_ranks  # noqa: E402

MB = 2**20
VARIANTS = [
    ("no offload", False, False),
    ("optimizer", True, False),
    ("activations", False, True),
    ("both", True, True),
]


def _recipe(args: argparse.Namespace, dp: int, optimizer: bool, activations: bool, out: str) -> dict:
    return {
        "experiment": {"name": "offload", "output_dir": out},
        "model": llama_model("bf16", args.hidden, args.layers, args.ffn, args.vocab, args.seq),
        "data": {"seq_length": args.seq, "batch_size": 1},
        "optim": {"lr": 1e-4, "max_steps": 100, "warmup_steps": 1, "offload_optimizer": optimizer},
        "distributed": {"zero_optimization": 1 if dp > 1 else 0},
        "training": {"activation_offload_layers": args.layers if activations else 0},
        "logging": {"log_interval": 1000, "ckpt_interval": 0},
    }


def _measure(args: argparse.Namespace) -> list[dict]:
    import torch.distributed as dist

    from megacann.optimizer.memory import optimizer_memory

    dp = dist.get_world_size()
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for label, optimizer, activations in [VARIANTS[0], *VARIANTS]:  # the first pass warms the process up
            recipe = _recipe(args, dp, optimizer, activations, out)
            with random_token_trainer(recipe, seed=dist.get_rank()) as trainer:
                trainer.train_step()
                times = timed_steps(trainer, args.steps)
                memory = optimizer_memory(trainer.optimizer)
                acts = trainer.activation_offload
                rows.append(
                    {
                        "variant": label,
                        "dp": dp,
                        "psi": sum(p.numel() for p in trainer.optimizer.model_params),
                        **memory,
                        "host_activations": acts.host_peak,
                        "moved_activations": acts.moved_to_host,
                        "step_time": min(times),
                    }
                )
            del trainer
    return rows[1:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=3)
    add_llama_size_args(parser, hidden=512, layers=6, ffn=1408, vocab=32000, seq=128)
    args = parser.parse_args(argv)
    rows = []
    for dp in args.dp:
        rows += run_on_ranks(_measure, dp, args=(args,), timeout=1800)[0]
    print(
        f"model: {rows[0]['psi'] / 1e6:.1f}M parameters, bf16, seq {args.seq}, micro-batch 1; MB = 2^20 bytes per rank"
    )
    print(
        f"{'dp':>2} {'variant':<12} | {'params':>7} {'grads':>7} {'optim':>7} {'device':>7} | "
        f"{'host opt':>8} {'host act':>8} | {'step s':>6} {'vs none':>7}"
    )
    base = {r["dp"]: r["step_time"] for r in rows if r["variant"] == "no offload"}
    for r in rows:
        device = r["params"] + r["grads"] + r["optimizer_states"]
        print(
            f"{r['dp']:>2} {r['variant']:<12} | {r['params'] / MB:>7.1f} {r['grads'] / MB:>7.1f} "
            f"{r['optimizer_states'] / MB:>7.1f} {device / MB:>7.1f} | {r['host'] / MB:>8.1f} "
            f"{r['host_activations'] / MB:>8.1f} | {r['step_time']:>6.2f} {r['step_time'] / base[r['dp']]:>6.2f}x"
        )


if __name__ == "__main__":
    main()
