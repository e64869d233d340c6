"""MoE dispatch + expert compute against a dense SwiGLU MLP with the same active FLOPs, in one run.

    python benchmarks/moe_dispatch.py [--tokens 4096] [--hidden 512] [--ffn 512] [--experts 8] [--top_k 2]
                                      [--dtype fp32|bf16] [--repeats 10] [--threads N]

Timings of forward + backward on ``tokens`` tokens (median of ``repeats`` after two warm-up rounds; the
variants take turns in every round):

- ``moe reference``: permute by expert, one ``F.linear`` per expert for each projection, unpermute and
  weight (every MoE op pinned to its PyTorch reference);
- ``moe default``: the device's default implementations (``megacann.ops.selected``): on CPU the C++
  unpermute and grouped matmul (``cpp``: the experts' products of a call cut into one piece per thread),
  ``torch._grouped_mm`` on CUDA, torch_npu's grouped matmul and permute kernels on NPU;
- ``moe gather`` (CPU, when the default is ``cpp``): the default ops with the grouped matmul pinned to
  ``gather`` (one ``torch.mm`` per expert into one output, :mod:`megacann.ops.moe_gather`);
- ``moe torch._grouped_mm`` (CPU only): the default ops with torch's CPU grouped matmul pinned;
- ``dense``: a SwiGLU MLP of width ``top_k * ffn``, which does the same matmul FLOPs per token as
  ``top_k`` experts of width ``ffn``.

The routing is drawn once (uniform random choices, softmax weights) and is not timed; expert
parallelism's all-to-all is not part of it (one process). The ratios MoE / dense are the overhead of
permuting, unpermuting and computing experts in groups. Each row also gives the median number of minor
page faults per step (``getrusage``; 4 KiB each): memory glibc maps afresh and the kernel zero-fills on
first touch, which costs time the dense step may not pay (how much changes from run to run with the heap's
history). On CPU the benchmark runs under the host-memory policy a CPU training run applies
(:mod:`megacann.host_memory`: glibc keeps freed memory mapped), so no step faults after warm-up; for
glibc's defaults instead:

    MEGACANN_HOST_MALLOC=system python benchmarks/moe_dispatch.py ...

On a shared CPU the figures are noisy: compare the ratios of one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from megacann import ops
from megacann.accelerator import get_accelerator
from megacann.host_memory import keep_freed_host_memory
from megacann.layers import SwiGLUMLP
from megacann.layers.init import init_normal
from megacann.layers.moe import GroupedExperts, TokenDispatcher

MOE_OPS = ("moe_permute", "moe_unpermute", "grouped_matmul")
GROUPED_ON_CPU = "torch_grouped_mm_cpu"  # not the CPU default, so pinned here


def _pin(kernels: dict[str, str | None]) -> None:
    for op, name in kernels.items():
        ops.pin(op, name)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _interleaved_medians(steps: dict, repeats: int, sync) -> dict[str, tuple[float, float]]:
    """Median seconds and minor page faults per step; the steps take turns in every round, so a machine
    whose load drifts during the run slows them alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    faults: dict[str, list[int]] = {name: [] for name in steps}
    for round_ in range(repeats + 2):  # two warm-up rounds
        for name, (kernels, step) in steps.items():
            _pin({op: None for op in MOE_OPS})
            _pin(kernels)
            sync()
            first_fault, start = _minor_faults(), time.perf_counter()
            step()
            sync()
            if round_ >= 2:
                times[name].append(time.perf_counter() - start)
                faults[name].append(_minor_faults() - first_fault)
    _pin({op: None for op in MOE_OPS})
    return {name: (statistics.median(times[name]), statistics.median(faults[name])) for name in steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=512, help="width of one expert")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    accelerator = get_accelerator()
    device = accelerator.current_device()
    kept = device.type == "cpu" and keep_freed_host_memory()  # as setup_runtime does for a CPU run
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)

    init = init_normal(0.02)
    experts = GroupedExperts(args.experts, args.hidden, args.ffn, init, init, layer_seed=0, dtype=dtype, device=device)
    dense = SwiGLUMLP(args.hidden, args.top_k * args.ffn, init_method=init, dtype=dtype, device=device)
    dispatcher = TokenDispatcher(args.experts)
    x = torch.randn(args.tokens, args.hidden, dtype=dtype, device=device, requires_grad=True)
    choice = torch.rand(args.tokens, args.experts, device=device)
    expert_ids = choice.topk(args.top_k, dim=-1).indices
    probs = torch.softmax(torch.randn(args.tokens, args.top_k, device=device), dim=-1)
    grad = torch.randn(args.tokens, args.hidden, dtype=dtype, device=device)

    def moe_step():
        expert_input, counts, state = dispatcher.dispatch(x, probs, expert_ids)
        dispatcher.combine(experts(expert_input, counts), state, expert_output_unused_after=True).backward(grad)

    def dense_step():
        dense(x).backward(grad)

    reference = {op: "reference" for op in MOE_OPS}
    steps = {"moe reference": (reference, moe_step), "moe default": ({op: None for op in MOE_OPS}, moe_step)}
    if ops.selected("grouped_matmul", device.type) == "cpp":
        steps["moe gather"] = ({"grouped_matmul": "gather"}, moe_step)  # the products one torch.mm each
    if device.type == "cpu" and GROUPED_ON_CPU in ops.implementations("grouped_matmul"):
        steps["moe grouped_mm"] = ({"grouped_matmul": GROUPED_ON_CPU}, moe_step)  # not the CPU default: pinned
    steps["dense"] = ({}, dense_step)
    details = {}
    for name, (kernels, _) in steps.items():
        _pin({op: None for op in MOE_OPS})
        _pin(kernels)
        details[name] = ", ".join(f"{op}={ops.selected(op, device.type)}" for op in MOE_OPS)
    details["dense"] = f"SwiGLU ffn {args.top_k * args.ffn}"
    medians = _interleaved_medians(steps, args.repeats, accelerator.synchronize)

    flops = 3 * 2 * 3 * args.tokens * args.top_k * args.hidden * args.ffn  # fwd + bwd, three matmuls
    print(
        f"device {device.type}, {args.dtype}, threads {torch.get_num_threads()}: {args.tokens} tokens, hidden "
        f"{args.hidden}, {args.experts} experts x ffn {args.ffn}, top-{args.top_k}; forward + backward; "
        f"host memory {'kept mapped (megacann.host_memory)' if kept else 'the C library defaults'}"
    )
    dense_time = medians["dense"][0]
    for label, (seconds, faults) in medians.items():
        print(
            f"  {label:14s} {seconds * 1e3:8.2f} ms  {flops / seconds / 1e9:7.1f} GFLOP/s  "
            f"x{seconds / dense_time:5.2f} of dense  {faults * 4 / 1024:6.1f} MiB faulted   ({details[label]})"
        )


if __name__ == "__main__":
    main()
