"""Packed-document and context-parallel attention through the block kernels, against the paths they replace.

    python benchmarks/varlen_attention.py [--seq 8192 --docs 8 --heads 8 --kv-heads 2 --head-dim 64]
        [--cp 2 4 --cp-seq 4096] [--rounds 2] [--skip-packed] [--skip-ring]

Part 1, one process: causal attention over a packed row of ``--docs`` equal documents (``segment_ids``),
forward and backward, on the ``varlen`` path (one flash-kernel call per document, no mask) against the
``reference`` path (``F.scaled_dot_product_attention`` with the ``[s, s]`` boolean mask), in the same
process, alternating, best of ``--rounds``. Memory is the peak of the bytes alive of every tensor an
operator creates (a ``TorchDispatchMode``; a kernel's internal scratch is not seen), inputs excluded.

Part 2, context parallelism: one forward and backward of ring attention (``context_parallel_attention``,
algo ``ring``) over ``--cp-seq`` tokens without packing on ``cp`` gloo ranks (CPU processes, one thread
each), with the block op pinned to ``flash`` (PyTorch's CPU flash kernel with its lse) against
``reference`` (the fp32 tile code the ring ran before), in the same processes, alternating; the largest
rank's best time. Outputs agree to fp32 round-off (printed).
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_common import add_int_args  # first: puts the checkout and tests/ on sys.path
from context_parallel import LiveBytes  # bytes alive of every tensor an operator creates
from dist_harness import run_on_ranks

from megacann import ops

MIB = 2**20


def _qkv(b: int, s: int, heads: int, kv_heads: int, d: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(b, s, h, d, generator=gen).requires_grad_() for h in (heads, kv_heads, kv_heads)
    ]  # fmt: skip


def _packed_once(impl: str, q, k, v, segments) -> tuple[float, int, torch.Tensor]:
    ops.pin("scaled_dot_product_attention", impl)
    try:
        with LiveBytes() as live:
            start = time.perf_counter()
            out = ops.scaled_dot_product_attention(q, k, v, segment_ids=segments)
            out.backward(torch.ones_like(out))
            seconds = time.perf_counter() - start
    finally:
        ops.pin("scaled_dot_product_attention", None)
    for t in (q, k, v):
        t.grad = None
    return seconds, live.peak, out.detach()


def packed(args: argparse.Namespace) -> None:
    q, k, v = _qkv(1, args.seq, args.heads, args.kv_heads, args.head_dim)
    segments = torch.arange(args.docs).repeat_interleave(args.seq // args.docs).unsqueeze(0)
    best: dict[str, list] = {}
    outs = {}
    for _ in range(args.rounds):
        for impl in ("reference", "varlen"):
            seconds, peak, outs[impl] = _packed_once(impl, q, k, v, segments)
            prev = best.get(impl)
            best[impl] = [min(seconds, prev[0]) if prev else seconds, max(peak, prev[1]) if prev else peak]
    diff = (outs["varlen"] - outs["reference"]).abs().max().item()
    print(
        f"packed attention: seq {args.seq}, {args.docs} documents, heads {args.heads}/{args.kv_heads}, "
        f"head dim {args.head_dim}, fp32, forward + backward, best of {args.rounds}; max |diff| {diff:.2e}"
    )
    print(f"{'path':>10} | {'seconds':>8} | {'peak MiB':>9}")
    for impl in ("reference", "varlen"):
        print(f"{impl:>10} | {best[impl][0]:8.3f} | {best[impl][1] / MIB:9.1f}")
    ref, new = best["reference"], best["varlen"]
    print(f"varlen / reference: time {new[0] / ref[0]:.3f}x, peak memory {new[1] / ref[1]:.3f}x")


def _ring_rank(args: argparse.Namespace) -> dict:
    from megacann import parallel_state as ps
    from megacann.layers.context_parallel import context_parallel_attention, context_parallel_split

    torch.set_num_threads(1)
    ps.initialize_model_parallel(context_parallel_size=torch.distributed.get_world_size())
    full = _qkv(1, args.cp_seq, args.heads, args.kv_heads, args.head_dim, seed=1)
    q, k, v = (context_parallel_split(t.detach()).requires_grad_() for t in full)
    times: dict[str, float] = {}
    outs = {}
    for _ in range(args.rounds):
        for impl in ("reference", "flash"):
            ops.pin("attention_block", impl)
            ops.pin("attention_block_backward", impl)
            torch.distributed.barrier()
            start = time.perf_counter()
            out = context_parallel_attention(q, k, v, algo="ring")
            out.backward(torch.ones_like(out))
            seconds = time.perf_counter() - start
            times[impl] = min(seconds, times.get(impl, float("inf")))
            outs[impl] = out.detach()
            for t in (q, k, v):
                t.grad = None
    ops.pin("attention_block", None)
    ops.pin("attention_block_backward", None)
    ps.destroy_model_parallel()
    return {"times": times, "diff": (outs["flash"] - outs["reference"]).abs().max().item()}


def ring(args: argparse.Namespace) -> None:
    print(
        f"ring attention: seq {args.cp_seq}, heads {args.heads}/{args.kv_heads}, head dim {args.head_dim}, fp32, "
        f"forward + backward, one thread per rank, best of {args.rounds} (largest rank)"
    )
    print(f"{'cp':>3} | {'reference s':>11} | {'flash s':>8} | {'flash/ref':>9} | max |diff|")
    for cp in args.cp:
        per_rank = run_on_ranks(_ring_rank, cp, args=(args,), timeout=args.timeout)
        slowest = {impl: max(r["times"][impl] for r in per_rank) for impl in ("reference", "flash")}
        diff = max(r["diff"] for r in per_rank)
        ratio = slowest["flash"] / slowest["reference"]
        print(f"{cp:>3} | {slowest['reference']:11.3f} | {slowest['flash']:8.3f} | {ratio:9.3f} | {diff:.2e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_int_args(parser, seq=8192, docs=8, heads=8, kv_heads=2, head_dim=64)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    add_int_args(parser, cp_seq=4096, rounds=2)
    parser.add_argument("--skip-packed", action="store_true")
    parser.add_argument("--skip-ring", action="store_true")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    if not args.skip_packed:
        packed(args)
    if not args.skip_ring:
        ring(args)


if __name__ == "__main__":
    main()
