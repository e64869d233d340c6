"""bf16 / fp16 products on CPU: PyTorch's own low-precision matmul against megacann's fp32-GEMM route
(:mod:`megacann.ops.bf16_matmul`) and the fp32 matmul of the same shape, forward + backward, in one process.

    python benchmarks/cpu_bf16_matmul.py [--tokens 1024 --repeat 3 --dtypes bf16 fp16 --cases linear lora ...]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/cpu_bf16_matmul.py

Cases (the shapes of ``cpu_train_step.py``'s model, d512, ffn 1376):

- ``linear``: ``ops.linear`` for the qkv / o, gate|up and down projections;
- ``lora``: a rank-16 LoRA's A and B on the fused gate|up (``LoRAAdapter``, the expanded-B path: gate only);
- ``expert``: one MoE expert's own MLP (``ExpertMLP``: gate|up, SwiGLU, down) on a quarter of the tokens;
- ``tp_overlap``: the overlapped sequence-parallel qkv projection (``distributed.tp_comm_overlap``) on a
  one-rank gloo group, so only its products are timed.

Prints the seconds of each and the route's speed-up over the native low-precision matmul; ``auto`` says
which one megacann picks here per dtype.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from megacann import ops
from megacann.ops import bf16_matmul

SHAPES = {"qkv / o": (512, 512), "gate|up": (2752, 512), "down": (512, 1376)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
Case = Callable[[torch.dtype], tuple[Callable[[], torch.Tensor], list[torch.Tensor]]]


def step_time(forward: Callable[[], torch.Tensor], repeat: int) -> float:
    """Seconds of one forward + backward (a ones gradient), after a warm-up."""

    def once() -> None:
        y = forward()
        y.backward(torch.ones_like(y))

    once()
    start = time.perf_counter()
    for _ in range(repeat):
        once()
    return (time.perf_counter() - start) / repeat


def linear_cases(tokens: int) -> dict[str, Case]:
    def make(out_features: int, in_features: int) -> Case:
        def build(dtype):
            x = torch.randn(tokens, in_features).to(dtype).requires_grad_()
            w = (torch.randn(out_features, in_features) / in_features**0.5).to(dtype).requires_grad_()
            return (lambda: ops.linear(x, w)), [x, w]

        return build

    return {f"linear {name} [{o}x{i}]": make(o, i) for name, (o, i) in SHAPES.items()}


def lora_case(tokens: int) -> Case:
    from megacann.layers import ColumnParallelLinear
    from megacann.layers.lora import LoRAConfig, attach_lora

    def build(dtype):
        layer = ColumnParallelLinear(512, 2752, bias=False, tp_blocks=(1376, 1376))
        attach_lora(torch.nn.ModuleDict({"gate_up_proj": layer}), LoRAConfig(rank=16, target_modules=("gate_proj",)))
        adapter = layer.adapter.to(dtype)
        torch.nn.init.normal_(adapter.lora_B.data, std=0.02)
        x = torch.randn(tokens, 512).to(dtype).requires_grad_()
        return (lambda: adapter(x)), [x, *adapter.parameters()]

    return build


def expert_case(tokens: int) -> Case:
    from megacann.layers.moe import ExpertMLP

    def build(dtype):
        def init(t):
            return t.normal_(0.0, 0.02)

        expert = ExpertMLP(512, 1376, 0, 1, init, init, dtype=dtype)
        x = torch.randn(tokens // 4, 512).to(dtype).requires_grad_()
        return (lambda: expert(x)), [x, *expert.parameters()]

    return build


def tp_overlap_case(tokens: int) -> Case:
    from megacann.layers.tp_overlap import overlapped_gather_linear

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo", rank=0, world_size=1)

    def build(dtype):
        x = torch.randn(1, tokens, 512).to(dtype).requires_grad_()
        w = (torch.randn(1536, 512) / 512**0.5).to(dtype).requires_grad_()
        return (lambda: overlapped_gather_linear(x, w, None, dist.group.WORLD)), [x, w]

    return build


def measure(build: Case, dtype: torch.dtype, repeat: int) -> dict[str, float]:
    forward, leaves = build(torch.float32)
    times = {"fp32": step_time(forward, repeat)}
    forward, leaves = build(dtype)
    for label, on in (("native", False), ("route", True)):
        with bf16_matmul.forced(on):
            times[label] = step_time(forward, repeat)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--cases", nargs="+", default=["linear", "lora", "expert", "tp_overlap"])
    args = parser.parse_args()
    picks = ", ".join(f"{n} {'fp32 GEMMs' if bf16_matmul.enabled(d) else 'native'}" for n, d in DTYPES.items())
    print(
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads, {args.tokens} tokens; auto picks: {picks}"
    )
    cases: dict[str, Case] = {}
    for name in args.cases:
        if name == "linear":
            cases.update(linear_cases(args.tokens))
        else:
            cases[name] = {"lora": lora_case, "expert": expert_case, "tp_overlap": tp_overlap_case}[name](args.tokens)
    for dtype_name in args.dtypes:
        for name, build in cases.items():
            times = measure(build, DTYPES[dtype_name], args.repeat)
            print(
                f"{dtype_name} {name:28s}: fp32 {times['fp32']:.4f} s, {dtype_name} native {times['native']:.4f} s, "
                f"as fp32 GEMMs {times['route']:.4f} s; route {times['native'] / times['route']:.2f}x"
            )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
