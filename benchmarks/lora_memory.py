"""LoRA against full fine-tuning of the same model: trainable parameters, measured bytes and step time.

    python benchmarks/lora_memory.py [--steps 3] [--hidden 512 --layers 6 --vocab 32000 --seq 256] [--precision bf16]

One LLaMA of about 50M parameters (bf16 by default), trained on random tokens by the real Trainer in one
process (a spawned gloo rank, one thread), in turn: every parameter trained (full fine-tuning), LoRA rank 8
on q/k/v/o, and LoRA rank 8 on all seven projections. Bytes come from the tensors' storages after a step
(``megacann.optimizer.memory``): the weights (all of them, frozen included), the fp32 gradient buffers and
the optimizer state (fp32 masters of low-precision trainable parameters and Adam's two moments); they are
what a checkpoint-free device must hold besides activations. Step time: the fastest of the timed steps
after one warm-up (on a shared machine, the least disturbed one). Ratios are against full fine-tuning,
measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from bench_common import RandomTokens, add_int_args, add_llama_size_args, llama_model  # first: tests/ on sys.path
from dist_harness import run_on_ranks  # the tests' gloo launcher: N ranks, hard timeout

MB = 2**20
VARIANTS = [
    ("full fine-tuning", []),
    ("LoRA r8 q,k,v,o", ["lora=true", "lora_rank=8", "lora_target_modules=[q_proj,k_proj,v_proj,o_proj]"]),
    ("LoRA r8 all-linear", ["lora=true", "lora_rank=8", "lora_target_modules=all-linear"]),
]


def _config(args: argparse.Namespace, overrides: list[str], out: str):
    from megacann.config import apply_overrides, config_from_dict
    from megacann.training.recipe import prepare_recipe

    cfg = config_from_dict(
        {
            "experiment": {"name": "lora_memory", "output_dir": out},
            "train_mode": "sft",
            "model": llama_model(args.precision, args.hidden, args.layers, args.ffn, args.vocab, args.seq),
            "data": {"seq_length": args.seq, "batch_size": args.batch},
            "optim": {"max_steps": 100},
            "logging": {"log_interval": 1000, "ckpt_interval": 0},
        }
    )
    apply_overrides(cfg, overrides)
    prepare_recipe(cfg, world_size=1)
    return cfg


def _measure(args: argparse.Namespace) -> list[dict]:
    from megacann import parallel_state as ps
    from megacann.optimizer.memory import optimizer_memory, storage_bytes
    from megacann.training import finetune
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    rows = []
    with tempfile.TemporaryDirectory() as out:
        for label, overrides in VARIANTS:
            cfg = _config(args, overrides, out)
            trainer = Trainer(cfg, setup_runtime(cfg), data=RandomTokens(args.vocab, args.seq, args.batch, seed=0))
            trainer.train_step()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                trainer.train_step()
                times.append(time.perf_counter() - start)
            trainable, total = finetune.parameter_counts(trainer.model_chunks)
            memory = optimizer_memory(trainer.optimizer)
            weights = storage_bytes(p for chunk in trainer.model_chunks for p in chunk.parameters())
            rows.append(
                {
                    "variant": label,
                    "trainable": trainable,
                    "total": total,
                    "weights": weights,
                    "grads": memory["grads"],
                    "optimizer_states": memory["optimizer_states"],
                    "step_time": min(times),
                }
            )
            trainer.metrics.close()
            del trainer
            ps.destroy_model_parallel()
    return rows


def report(rows: list[dict], args: argparse.Namespace) -> str:
    full = rows[0]
    lines = [
        f"LLaMA h{args.hidden} L{args.layers} ffn{args.ffn} vocab{args.vocab}, {args.precision}, seq {args.seq} x "
        f"batch {args.batch}, one CPU process; bytes measured from the tensors after a step (MiB)",
        f"{'variant':<20} {'trainable':>12} {'of total':>9} {'weights':>9} {'grads':>9} {'optim':>9} "
        f"{'w+g+o':>9} {'vs full':>8} {'step s':>8} {'vs full':>8}",
    ]
    for r in rows:
        held = r["weights"] + r["grads"] + r["optimizer_states"]
        full_held = full["weights"] + full["grads"] + full["optimizer_states"]
        lines.append(
            f"{r['variant']:<20} {r['trainable']:>12,} {100 * r['trainable'] / r['total']:>8.2f}% "
            f"{r['weights'] / MB:>9.1f} {r['grads'] / MB:>9.1f} {r['optimizer_states'] / MB:>9.1f} "
            f"{held / MB:>9.1f} {held / full_held:>8.3f} {r['step_time']:>8.3f} {r['step_time'] / full['step_time']:>8.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_llama_size_args(parser, hidden=512, layers=6, ffn=1408, vocab=32000, seq=256)
    add_int_args(parser, batch=2)
    parser.add_argument("--precision", choices=("bf16", "fp32", "fp16"), default="bf16")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up)")
    args = parser.parse_args(argv)
    rows = run_on_ranks(_measure, 1, args=(args,), timeout=1800)[0]
    print(report(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
