"""Context parallelism: per-rank activation memory of one training step of a whole model against the ideal 1/cp.

    python benchmarks/context_parallel.py [--seq 4096 8192 16384 32768] [--cp 1 2 4]
        [--algo ring allgather ulysses] [--hidden 128 --heads 4 --kv-heads 2 --ffn 256 --layers 2 --vocab 1024]

A small LLaMA (embedding, ``--layers`` blocks with GQA attention, RoPE and SwiGLU, final norm, output
layer and loss; fp32, micro-batch 1, the recipe's default operators) is built by the model family and run
through the trainer's own schedule (``Trainer.forward_backward``: one forward and backward of a
micro-batch of ``seq`` random tokens) on ``cp`` gloo ranks (CPU processes, one thread each). The schedule
hands each rank its load-balanced share of the sequence (``context_parallel_batch``), as in training.

Bytes are counted exactly, from the tensors themselves; parameters, gradient buffers and the batch exist
before the step and are not counted:

- ``stored``: the most bytes autograd keeps for backward at once (saved-tensor hooks; each storage once),
  i.e. the activations;
- ``peak``: the most bytes alive at any moment of the step, of every tensor an operator creates (a
  ``TorchDispatchMode``, until the storage is freed): stored activations, temporaries, gradients in
  flight, communication buffers (scratch memory a fused kernel allocates internally is not seen).

Each is shown as a ratio to cp 1 at the same sequence length beside the ideal ``1/cp``; the largest rank
is reported (the layout gives every rank the same work). The loss of the step is printed too: every
layout computes the same one. cp 1 runs plain attention (the algorithm does not matter there).
"""

from __future__ import annotations

import argparse
import tempfile
import weakref

import torch
from bench_common import add_int_args  # first: puts tests/ on sys.path
from dist_harness import run_on_ranks  # the tests' gloo launcher: N ranks, hard timeout
from test_planner import SavedTensorTracker  # bytes autograd saves, as the planner's test counts them
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from train_vs_transformers import llama_model_section  # the recipe's model section from the size options

MIB = 2**20


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created by operators while active and not yet freed (and their peak)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out


def _config(args: argparse.Namespace, seq: int, cp: int, algo: str, out: str):
    from megacann.config import config_from_dict

    return config_from_dict(
        {
            "experiment": {"name": "context_parallel", "output_dir": out},
            "model": llama_model_section(args, "fp32", max(args.seq)),
            "data": {"seq_length": seq, "batch_size": 1},
            "optim": {"grad_accum_steps": 1, "max_steps": 1},
            "distributed": {"context_parallel_size": cp, "context_parallel_algo": algo},
            "logging": {"ckpt_interval": 0},
        }
    )


class _NoData:
    """The trainer's data interface, unused: the benchmark hands the schedule its micro-batch itself."""

    train = iter(())

    def valid(self):
        return None


def _measure(args: argparse.Namespace, algo: str) -> list[dict]:
    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    cp = torch.distributed.get_world_size()
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for seq in args.seq:
            ps.destroy_model_parallel()
            cfg = _config(args, seq, cp, algo, out)
            trainer = Trainer(cfg, setup_runtime(cfg), data=_NoData())
            generator = torch.Generator().manual_seed(seq)  # the same sample on every rank and layout
            row = torch.randint(0, args.vocab, (1, seq + 1), generator=generator)
            batch = {"tokens": row[:, :-1].contiguous(), "labels": row[:, 1:].contiguous()}
            params = {p.untyped_storage().data_ptr() for p in trainer.params}
            saved = SavedTensorTracker(params)
            with LiveBytes() as live, torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                totals = trainer.forward_backward(trainer.model_chunks, [batch], loss_normalizer=float(seq))
            loss = totals.reduce(float(seq))["loss"]
            rows.append(dict(seq=seq, local=seq // cp, stored=saved.peak, peak=live.peak, loss=loss))
    ps.destroy_model_parallel()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--algo", nargs="+", default=["ring", "allgather", "ulysses"])
    add_int_args(parser, hidden=128, heads=4, kv_heads=2, ffn=256, layers=2, vocab=1024)
    parser.add_argument("--timeout", type=float, default=7200)
    args = parser.parse_args(argv)

    results: dict[tuple[int, str], list[dict]] = {}
    for cp in args.cp:
        for algo in ["ring"] if cp == 1 else args.algo:
            per_rank = run_on_ranks(_measure, cp, args=(args, algo), timeout=args.timeout)
            results[(cp, algo)] = [
                {**rows[0], "stored": max(r["stored"] for r in rows), "peak": max(r["peak"] for r in rows)}
                for rows in zip(*per_rank)
            ]
    base = {row["seq"]: row for row in results.get((1, "ring"), [])}
    print(
        f"LLaMA: {args.layers} layers, hidden {args.hidden}, heads {args.heads}, kv heads {args.kv_heads}, "
        f"ffn {args.ffn}, vocab {args.vocab}; fp32, micro-batch 1, one training step's forward and backward "
        f"on CPU; MiB per rank (largest rank)"
    )
    print(
        f"{'seq':>6} {'cp':>3} {'algo':>9} {'tokens':>7} | {'stored':>8} {'/cp1':>6} | {'peak':>8} {'/cp1':>6} | "
        f"{'ideal':>5} | loss"
    )
    for (cp, algo), rows in sorted(results.items()):
        for row in rows:
            ref = base.get(row["seq"])
            ratio = {key: f"{row[key] / ref[key]:6.3f}" if ref else f"{'-':>6}" for key in ("stored", "peak")}
            print(
                f"{row['seq']:>6} {cp:>3} {algo if cp > 1 else '-':>9} {row['local']:>7} | "
                f"{row['stored'] / MIB:8.1f} {ratio['stored']} | {row['peak'] / MIB:8.1f} {ratio['peak']} | "
                f"{1 / cp:5.3f} | {row['loss']:.6f}"
            )


if __name__ == "__main__":
    main()
