"""The gated delta rule's chunked form against its token-by-token recurrence and against softmax attention of
the same width, from 1k to 16k tokens: time and peak memory of forward + backward, and where the lines cross.

    python benchmarks/gated_delta.py [--seqs 1024 2048 4096 8192 16384] [--heads 8 --head-dim 64]
        [--recurrent-up-to 2048] [--attention-up-to 16384] [--rounds 2] [--threads 0]

One process, batch 1, fp32, on the CPU (``--threads 0``: torch's default). Each row runs, alternating, best
of ``--rounds``:

- ``chunked``: :func:`megacann.ops.gated_delta_rule` pinned to ``chunked`` (64-token chunks, autograd);
- ``recurrent``: the same op pinned to ``reference`` (the state updated token by token), up to
  ``--recurrent-up-to`` tokens (its time grows linearly and it is slow: one autograd node per token);
- ``attention``: causal :func:`megacann.ops.scaled_dot_product_attention` with as many heads of the same
  size (q, k, v ``[1, s, heads, head_dim]``), up to ``--attention-up-to`` tokens.

Memory is the peak of the bytes alive of every tensor an operator creates (``LiveBytes``; a kernel's
internal scratch is not seen), inputs excluded, measured in a run of its own after the timed ones (the
dispatch mode that counts the bytes costs time per operator, which would swamp the recurrence's). The last lines name the first length at which the
chunked rule is faster than attention and the first at which it holds less memory.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_common import add_int_args  # first: puts the checkout and tests/ on sys.path
from context_parallel import LiveBytes  # bytes alive of every tensor an operator creates

from megacann import ops

MIB = 2**20
PATHS = ("chunked", "recurrent", "attention")


def _inputs(s: int, heads: int, d: int) -> list[torch.Tensor]:
    """q, k (unit norm), v, g, beta of one row, as a Gated DeltaNet layer makes them."""
    gen = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(1, s, heads, d, generator=gen) for _ in range(3))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = -0.05 * F.softplus(torch.randn(1, s, heads, generator=gen))
    beta = torch.rand(1, s, heads, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _forward_backward(path: str, inputs: list[torch.Tensor]) -> None:
    q, k, v, g, beta = inputs
    if path == "attention":
        out = ops.scaled_dot_product_attention(q, k, v, causal=True)
    else:
        ops.pin("gated_delta_rule", "chunked" if path == "chunked" else "reference")
        try:
            out, _ = ops.gated_delta_rule(q, k, v, g, beta)
        finally:
            ops.pin("gated_delta_rule", None)
    out.backward(torch.ones_like(out))
    for t in inputs:
        t.grad = None


def _seconds(path: str, inputs: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    _forward_backward(path, inputs)
    return time.perf_counter() - start


def _peak_bytes(path: str, inputs: list[torch.Tensor]) -> int:
    with LiveBytes() as live:
        _forward_backward(path, inputs)
    return live.peak


def _crossing(rows: list[dict], key: int) -> str:
    """The first length where the chunked rule beats attention on ``key`` (0: time, 1: memory)."""
    for row in rows:
        if "attention" in row and row["chunked"][key] < row["attention"][key]:
            return str(row["seq"])
    return "not within the lengths measured"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    add_int_args(parser, heads=8, head_dim=64, recurrent_up_to=2048, attention_up_to=16384, rounds=2, threads=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"gated delta rule vs softmax attention: batch 1, {args.heads} heads x {args.head_dim}, fp32, forward + "
        f"backward, {torch.get_num_threads()} threads, best of {args.rounds}; "
        f"chunked = {ops.implementations('gated_delta_rule')[1:2]}"
    )
    print(f"{'seq':>6} | " + " | ".join(f"{p + ' s':>12} {'MiB':>8}" for p in PATHS))
    rows = []
    for s in args.seqs:
        inputs = _inputs(s, args.heads, args.head_dim)
        wanted = [p for p in PATHS if not (p == "recurrent" and s > args.recurrent_up_to)]
        wanted = [p for p in wanted if not (p == "attention" and s > args.attention_up_to)]
        times: dict[str, float] = {}
        for _ in range(args.rounds):
            for path in wanted:
                times[path] = min(times.get(path, float("inf")), _seconds(path, inputs))
        row: dict = {"seq": s, **{path: (times[path], _peak_bytes(path, inputs)) for path in wanted}}
        rows.append(row)
        cells = [f"{row[p][0]:12.3f} {row[p][1] / MIB:8.1f}" if p in row else f"{'-':>12} {'-':>8}" for p in PATHS]
        print(f"{s:>6} | " + " | ".join(cells), flush=True)
    print(f"chunked faster than attention from {_crossing(rows, 0)} tokens on")
    print(f"chunked holds less memory than attention from {_crossing(rows, 1)} tokens on")
    for row in rows:
        if "recurrent" in row:
            print(f"seq {row['seq']}: recurrent / chunked time {row['recurrent'][0] / row['chunked'][0]:.1f}x")


if __name__ == "__main__":
    main()
