"""Context parallelism: per-rank activation memory of one training step against the ideal 1/cp.

    python benchmarks/context_parallel.py [--seq 4096 8192 16384 32768] [--cp 1 2 4]
        [--algo ring allgather ulysses] [--hidden 128 --heads 4 --kv-heads 2 --ffn 256 --layers 2]

A stack of LLaMA-style ``TransformerBlock``s (RMSNorm, GQA attention with RoPE, SwiGLU; fp32, micro-batch
1) built from ``megacann.layers`` runs one forward and backward on ``cp`` gloo ranks (CPU processes, one
thread each), each holding its load-balanced share of the sequence. This is the layer stack alone: the
embedding, the output layer and the loss come with the model integration.

Bytes are counted exactly, from the tensors themselves: every tensor an operator creates during the step
is tracked (a ``TorchDispatchMode``) until its storage is freed; parameters and the input exist before and
are not counted, nor is scratch memory a fused kernel allocates internally. Two figures per rank:

- ``stored``: bytes alive at the end of forward, i.e. what is kept for backward (the activations);
- ``peak``: the most bytes alive at any moment of forward + backward (stored activations, temporaries,
  gradients in flight, communication buffers).

Each is shown as a ratio to cp 1 at the same sequence length beside the ideal ``1/cp``; the largest rank
is reported (the layout gives every rank the same work, so they agree). cp 1 runs plain attention (the
algorithm does not matter there).
"""

from __future__ import annotations

import argparse
import os
import sys
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from dist_harness import run_on_ranks  # noqa: E402  (the tests' gloo launcher: N spawned ranks, hard timeout)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

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


def _measure(args: argparse.Namespace, algo: str) -> list[dict]:
    from megacann import parallel_state as ps
    from megacann.layers import (
        TransformerBlock,
        TransformerBlockConfig,
        context_parallel_split,
        model_parallel_manual_seed,
    )

    ps.initialize_model_parallel(context_parallel_size=torch.distributed.get_world_size())
    cfg = TransformerBlockConfig(
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        ffn_hidden_size=args.ffn,
        context_parallel_algo=algo,
    )
    model_parallel_manual_seed(1)
    blocks = torch.nn.ModuleList(TransformerBlock(cfg) for _ in range(args.layers))
    for p in blocks.parameters():  # gradients accumulate into buffers that exist before the step
        p.grad = torch.zeros_like(p)
    rows = []
    for seq in args.seq:
        generator = torch.Generator().manual_seed(seq)
        x = context_parallel_split(torch.randn(1, seq, args.hidden, generator=generator)).requires_grad_()
        with LiveBytes() as meter:
            hidden = x
            for block in blocks:
                hidden = block(hidden)
            stored = meter.current
            hidden.square().mean().backward()
            del hidden
        rows.append(dict(seq=seq, local=x.shape[1], stored=stored, peak=meter.peak))
    ps.destroy_model_parallel()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--algo", nargs="+", default=["ring", "allgather", "ulysses"])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600)
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
        f"{args.layers} x TransformerBlock(hidden {args.hidden}, heads {args.heads}, kv heads {args.kv_heads}, "
        f"ffn {args.ffn}), fp32, micro-batch 1, CPU; MiB per rank (largest rank)"
    )
    print(
        f"{'seq':>6} {'cp':>3} {'algo':>9} {'tokens':>7} | {'stored':>9} {'/cp1':>6} | {'peak':>9} {'/cp1':>6} | ideal"
    )
    for (cp, algo), rows in results.items():
        for row in rows:
            ref = base.get(row["seq"])
            ratio = {key: f"{row[key] / ref[key]:6.3f}" if ref else f"{'-':>6}" for key in ("stored", "peak")}
            print(
                f"{row['seq']:>6} {cp:>3} {algo if cp > 1 else '-':>9} {row['local']:>7} | "
                f"{row['stored'] / MIB:9.1f} {ratio['stored']} | {row['peak'] / MIB:9.1f} {ratio['peak']} | {1 / cp:.3f}"
            )


if __name__ == "__main__":
    main()
