"""bf16 linear layers on CPU: PyTorch's bf16 matmul against megacann's fp32-GEMM route
(:mod:`megacann.ops.bf16_matmul`) and the fp32 matmul of the same shape, forward + backward, in one process.

    python benchmarks/cpu_bf16_matmul.py [--tokens 1024 --repeat 3]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/cpu_bf16_matmul.py

Shapes: the projections of ``cpu_train_step.py``'s model (d512, ffn 1376). Prints the seconds of
each and the route's speed-up over the native bf16 matmul; ``auto`` says which one megacann picks here.
"""

from __future__ import annotations

import argparse
import time

import torch

from megacann import ops
from megacann.ops import bf16_matmul

SHAPES = {"qkv / o": (512, 512), "gate|up": (2752, 512), "down": (512, 1376)}


def step_time(x: torch.Tensor, w: torch.Tensor, repeat: int) -> float:
    def once() -> None:
        ops.linear(x, w).backward(torch.ones(x.shape[0], w.shape[0], dtype=x.dtype))

    once()
    start = time.perf_counter()
    for _ in range(repeat):
        once()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads; auto picks {'fp32 GEMMs' if bf16_matmul.enabled() else 'bf16 GEMMs'}"
    )
    for name, (out_features, in_features) in SHAPES.items():
        x = torch.randn(args.tokens, in_features)
        w = torch.randn(out_features, in_features) / in_features**0.5
        times = {"fp32": step_time(x.requires_grad_(), w.requires_grad_(), args.repeat)}
        xb, wb = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
        for label, on in (("bf16 native", False), ("bf16 as fp32", True)):
            with bf16_matmul.forced(on):
                times[label] = step_time(xb, wb, args.repeat)
        speedup = times["bf16 native"] / times["bf16 as fp32"]
        row = ", ".join(f"{label} {t:.3f} s" for label, t in times.items())
        print(
            f"{name:8s} [{args.tokens}, {in_features}] x [{out_features}, {in_features}]: {row}; route {speedup:.2f}x"
        )


if __name__ == "__main__":
    main()
