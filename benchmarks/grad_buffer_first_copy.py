"""What the gradient buffer costs a step beyond autograd handing its gradients over: the old step (zero the
whole fp32 buffer, then add every gradient into it; ``ZeroThenAdd`` below, the library keeps no copy of it)
against the first-gradient copy, with torch's own ``zero_grad(set_to_none=True)`` (the fresh gradient
becomes ``.grad``, no copy: what transformers' step does) as the floor, in one process, alternating rounds.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 MEGACANN_CPU_ISA=avx2 \\
        python benchmarks/grad_buffer_first_copy.py [--micro_batches 1 2 --rounds 5]

The parameters are the shapes of train_vs_transformers' model (default: its ``cpu`` preset, fp32). A
"backward" hands every parameter one fresh gradient per micro-batch through autograd (``torch.full``, a
stand-in for the weight-gradient product, the same in every mode); a step is zero, the micro-batches, then
``finish_grad_sync`` (one rank: no collective).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_vs_transformers import PRESETS  # noqa: E402

from megacann.optimizer.grad_buffer import GradBuffer, GradBuffers  # noqa: E402


def llama_shapes(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, **_) -> list[tuple]:
    """megacann's trainable shapes of an untied LLaMA: embedding, per layer two norms, q/k/v/o, gate-up and
    down, then the final norm and the head."""
    kv = hidden // heads * kv_heads
    attention = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]
    block = [(hidden,), *attention, (hidden,), (2 * ffn, hidden), (hidden, ffn)]
    return [(vocab, hidden)] + block * layers + [(hidden,), (vocab, hidden)]


class ZeroThenAdd(GradBuffer):
    """The step the library used before the first-gradient copy, kept here to measure against: ``zero()``
    fills the whole (persistent) buffer and makes every fp32 slot its parameter's ``.grad``, so autograd
    adds every gradient, the first included, into zeros."""

    def zero(self) -> None:
        super().zero()
        self.unwritten = set()  # every slot holds zeros: nothing is copied, nothing zeroed at the launch
        self.data.zero_()
        for p in self.params:
            if id(p) in self.aliased:
                p.grad = p.main_grad


class _Fresh(torch.autograd.Function):
    """A node whose backward gives its parameter a fresh gradient nothing else holds (as a weight-gradient
    product does), so autograd's AccumulateGrad may take it over."""

    @staticmethod
    def forward(ctx, param):
        ctx.shape = param.shape
        return param.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return torch.full(ctx.shape, 1e-3)


def backward(params: list[torch.nn.Parameter]) -> None:
    """One micro-batch: every parameter receives one fresh gradient, in one autograd call."""
    torch.autograd.backward([_Fresh.apply(p) for p in params])


def system(mode: str, shapes: list[tuple], micro_batches: int):
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    if mode == "set_to_none":

        def step() -> None:
            for p in params:
                p.grad = None
            for _ in range(micro_batches):
                backward(params)

        return step
    buffers = GradBuffers(params, bucket_size=40_000_000, buffer_cls=ZeroThenAdd if mode == "old" else GradBuffer)

    def step() -> None:
        buffers.zero()
        for _ in range(micro_batches):
            backward(params)
        buffers.finish_grad_sync()

    return step


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--micro_batches", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = llama_shapes(**PRESETS[args.preset])
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; "
        f"preset {args.preset}: {len(shapes)} parameters, {numel / 1e6:.1f} M fp32 elements"
    )
    for micro_batches in args.micro_batches:
        steps = {mode: system(mode, shapes, micro_batches) for mode in ("set_to_none", "old", "new")}
        for step in steps.values():
            step()  # warm-up
        times: dict[str, list[float]] = {mode: [] for mode in steps}
        for _ in range(args.rounds):
            for mode, step in steps.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[mode].append((time.perf_counter() - start) / args.steps)
        for label, pick in (("median", statistics.median), ("min", min)):  # min: the least disturbed round
            t = {mode: pick(values) for mode, values in times.items()}
            floor = t["set_to_none"]
            print(
                f"micro-batches {micro_batches} ({label} of {args.rounds}): set_to_none {1e3 * floor:.1f} ms | "
                f"old {1e3 * t['old']:.1f} ms ({1e3 * (t['old'] - floor):+.1f}) | new {1e3 * t['new']:.1f} ms "
                f"({1e3 * (t['new'] - floor):+.1f}) | new/old {t['new'] / t['old']:.2f}x",
                flush=True,
            )
        del steps


if __name__ == "__main__":
    main()
