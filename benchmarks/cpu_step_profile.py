"""Where a CPU train step spends its time, megacann beside transformers (``train_vs_transformers.py``'s two
steps): torch.profiler's self CPU time per operator, summed over ``--steps`` steps after a warm-up.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/cpu_step_profile.py --precision fp32 [--layers 2 --micro_batch 2 --top 15]

Takes train_vs_transformers' shape arguments (default: its ``cpu`` preset). Prints, per system, the total
and the ``--top`` operators by self CPU time with their share, so the two columns can be read side by side.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_vs_transformers import hf_step, megacann_trainer, parse_args  # noqa: E402


def profile(step, steps: int) -> list[tuple[str, float]]:
    step()  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    rows = [(e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    top = 15
    argv = sys.argv[1:]
    if "--top" in argv:
        i = argv.index("--top")
        top = int(argv[i + 1])
        del argv[i : i + 2]
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    for precision in args.precision:
        systems = {"transformers": hf_step(args, precision), "megacann": megacann_trainer(args, precision).train_step}
        for name, step in systems.items():
            rows = profile(step, args.steps)
            total = sum(seconds for _, seconds in rows)
            print(f"{precision} {name}: {total:.2f} s self CPU over {args.steps} steps")
            for key, seconds in rows[:top]:
                print(f"    {key:48s} {seconds:8.3f} s {100 * seconds / total:5.1f} %")


if __name__ == "__main__":
    main()
