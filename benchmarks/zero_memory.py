"""ZeRO memory: measured per-rank bytes of parameters, gradients and optimizer state beside the formulas.

    python benchmarks/zero_memory.py [--dp 1 2 4] [--steps 2] [--hidden 512 --layers 6 --vocab 32000]

One bf16 LLaMA of about 50M parameters, trained on random tokens by the real Trainer on ``dp`` gloo
ranks (CPU processes, one thread each), under plain data parallelism (ZeRO-0), ZeRO-1, ZeRO-2 and ZeRO-3,
with overlap_grad_reduce (and overlap_param_gather for ZeRO: ZeRO-3 prefetches the next block's weights). Bytes come from the tensors' storages
(``megacann.optimizer.memory``), after a step, on rank 0 (all ranks hold the same up to one bucket's
padding). The prediction is megacann's, which keeps gradients in fp32 buffers as Megatron does:
params 2 Psi (ZeRO-3: 2 Psi / N), grads 4 Psi (ZeRO-2/3: 4 Psi / N), fp32 master + Adam moments 12 Psi
(ZeRO-1/2/3: 12 Psi / N); the ZeRO paper's total (bf16 gradients: 16 Psi, 4 Psi + 12 Psi / N,
2 Psi + 14 Psi / N, 16 Psi / N) is shown too. ZeRO-3's "params" is the shard held between steps; "w peak"
is the most weight storage held at once in the forward (the shard, the chunk's own weights, the running
block and the prefetched next one).
"grads peak" is the most gradient storage held at once during the step: ZeRO-2 frees reduced buckets
during backward, but with gradient accumulation ("ZeRO-2 accum 2" rows) it keeps the full fp32
gradients between micro-batches (it reduces once per step), so its peak is then ZeRO-1's.
Step time: the fastest of the timed steps after one warm-up (each timed on its slowest rank): on a shared
machine the least disturbed one. Ranks are single-threaded processes sharing the machine's cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from bench_common import add_llama_size_args, llama_model, random_token_trainer, timed_steps  # noqa: E402
from dist_harness import run_on_ranks  # noqa: E402  (the tests' gloo launcher: N spawned ranks, hard timeout)
from zero3_checks import GatherProbe  # noqa: E402  (ZeRO-3: weights gathered before each block runs)

MB = 2**20
VARIANTS = [("ZeRO-0", 0, 1), ("ZeRO-1", 1, 1), ("ZeRO-2", 2, 1), ("ZeRO-2 accum 2", 2, 2), ("ZeRO-3", 3, 1)]


def _recipe(args: argparse.Namespace, stage: int, accum: int, out: str) -> dict:
    return {
        "experiment": {"name": "zero_memory", "output_dir": out},
        "model": llama_model("bf16", args.hidden, args.layers, args.ffn, args.vocab, args.seq),
        "data": {"seq_length": args.seq, "batch_size": 1},
        "optim": {"lr": 1e-4, "max_steps": 100, "warmup_steps": 1, "grad_accum_steps": accum},
        "distributed": {
            "zero_optimization": stage,
            "overlap_grad_reduce": True,
            "overlap_param_gather": stage > 0,
            "bucket_size_mb": args.bucket_mb,
        },
        "logging": {"log_interval": 1000, "ckpt_interval": 0},
    }


def _measure(args: argparse.Namespace) -> list[dict]:
    """On every rank: each variant in turn, a warm-up step, timed steps, then the bytes from the tensors."""
    import torch.distributed as dist

    from megacann.optimizer.memory import optimizer_memory

    dp = dist.get_world_size()
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for label, stage, accum in VARIANTS:
            with random_token_trainer(_recipe(args, stage, accum, out), seed=dist.get_rank()) as trainer:
                probe = GatherProbe(trainer) if stage == 3 else None
                trainer.train_step()
                times = timed_steps(trainer, args.steps)
                buffers = trainer.optimizer.grad_buffers.buffers
                memory = optimizer_memory(trainer.optimizer)
                item = 2  # bf16 weights
                weights_peak = memory["params"] + (item * probe.peak if probe else 0)
                shard_grads = sum(4 * b.shard.numel() for b in buffers if getattr(b, "shard", None) is not None)
                rows.append(
                    {
                        "variant": label,
                        "stage": stage,
                        "dp": dp,
                        "psi": sum(p.numel() for p in trainer.optimizer.model_params),
                        "padded": sum(b.numel for b in buffers),
                        **memory,
                        "grads_peak": shard_grads + 4 * sum(b.peak_allocated_numel for b in buffers),
                        "step_time": min(times),
                        "weights_peak": weights_peak,
                    }
                )
            del trainer, probe
    return rows


def predicted(psi: int, n: int, stage: int) -> dict[str, float]:
    """megacann's per-rank bytes (fp32 gradient buffers) and the ZeRO paper's total (bf16 gradients)."""
    paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
    return {
        "params": 2 * psi / (n if stage == 3 else 1),
        "grads": 4 * psi / (n if stage >= 2 else 1),
        "optimizer_states": 12 * psi / (n if stage else 1),
        "paper_total": paper,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=2)
    add_llama_size_args(parser, hidden=512, layers=6, ffn=1408, vocab=32000, seq=128)
    parser.add_argument("--bucket_mb", type=float, default=16.0)
    args = parser.parse_args(argv)
    header = (
        f"{'dp':>2} {'variant':<15} | {'params':>7} {'w peak':>7} {'grads':>7} {'peak':>7} {'states':>7} {'total':>7} | "
        f"{'params':>7} {'grads':>7} {'states':>7} {'total':>7} {'paper':>7} | {'step s':>6}"
    )
    rows = []
    for dp in args.dp:
        rows += run_on_ranks(_measure, dp, args=(args,), timeout=900)[0]
    psi = rows[0]["psi"]
    print(f"model: {psi / 1e6:.1f}M parameters (Psi), bf16, seq {args.seq}, micro-batch 1; MB = 2^20 bytes per rank")
    print(f"{'':19}| {'measured (from tensors)':^47} | {'predicted':^39} |")
    print(header)
    for r in rows:
        p = predicted(r["psi"], r["dp"], r["stage"])
        total = r["params"] + r["grads"] + r["optimizer_states"]
        p_total = p["params"] + p["grads"] + p["optimizer_states"]
        print(
            f"{r['dp']:>2} {r['variant']:<15} | {r['params'] / MB:7.1f} {r['weights_peak'] / MB:7.1f} {r['grads'] / MB:7.1f} "
            f"{r['grads_peak'] / MB:7.1f} {r['optimizer_states'] / MB:7.1f} {total / MB:7.1f} | "
            f"{p['params'] / MB:7.1f} {p['grads'] / MB:7.1f} {p['optimizer_states'] / MB:7.1f} {p_total / MB:7.1f} "
            f"{p['paper_total'] / MB:7.1f} | {r['step_time']:6.2f}"
        )
    pad = max(r["padded"] - r["psi"] for r in rows)
    print(f"padding: at most {pad} elements per rank's buffers (buckets padded to a multiple of dp)")


if __name__ == "__main__":
    main()
