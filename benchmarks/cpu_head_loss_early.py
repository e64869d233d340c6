"""The fused head loss on CPU, forward + backward: gradients summed in the forward (one shard, a token-mean
loss: no logits recomputed) against the recomputing backward, alternating in one process.

    python benchmarks/cpu_head_loss_early.py [--tokens 2048 --rounds 3]   # cpu_train_step.py's head: d512, vocab 32000
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megacann import ops
from megacann.ops import head_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden**-0.5).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=g)

    def step() -> float:
        start = time.perf_counter()
        loss = ops.vocab_parallel_head_loss(hidden, weight, target)
        (loss.sum() / args.tokens).backward()  # a token mean, as training hands back
        hidden.grad = weight.grad = None
        return time.perf_counter() - start

    step()
    times: dict[str, list[float]] = {"early": [], "recompute": []}
    for _ in range(args.rounds):
        for name, seconds in times.items():
            head_loss._EARLY_MISSED[0] = name == "recompute"
            seconds.append(step())
    head_loss._EARLY_MISSED[0] = False
    med = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"head loss fwd+bwd [{args.tokens}, {args.hidden}] x [{args.vocab}, {args.hidden}] fp32, "
        f"capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads: "
        f"early {med['early']:.2f} s, recompute {med['recompute']:.2f} s, "
        f"recompute/early {med['recompute'] / med['early']:.2f}x (rounds: "
        + "; ".join(f"{n} {', '.join(f'{t:.2f}' for t in ts)}" for n, ts in times.items())
        + ")"
    )


if __name__ == "__main__":
    main()
