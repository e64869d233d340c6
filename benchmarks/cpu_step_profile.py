"""Where a CPU train step spends its time, megacann beside transformers (``train_vs_transformers.py``'s two
steps): torch.profiler's self CPU time per operator, summed over ``--steps`` steps after a warm-up.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/cpu_step_profile.py --precision fp32 [--layers 2 --micro_batch 2 --top 15]

Takes train_vs_transformers' shape arguments (default: its ``cpu`` preset). Prints, per system, the total
and the ``--top`` operators by self CPU time with their share, so the two columns can be read side by side,
then the time each spends in matrix products and in attention kernels, and the bound those put on the
ratio: transformers' total over megacann's products plus attention, i.e. megacann's lead if everything
else it does cost nothing (both run the same MKL products and the same ATen attention kernel).
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


PRODUCTS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")


def category_seconds(rows: list[tuple[str, float]]) -> tuple[float, float]:
    """Self CPU seconds in matrix products and in attention kernels (forward and backward)."""
    products = sum(seconds for key, seconds in rows if key in PRODUCTS)
    attention = sum(seconds for key, seconds in rows if "attention" in key and key.startswith("aten::"))
    return products, attention


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
        totals, parts = {}, {}
        for name, step in systems.items():
            rows = profile(step, args.steps)
            totals[name] = total = sum(seconds for _, seconds in rows)
            print(f"{precision} {name}: {total:.2f} s self CPU over {args.steps} steps")
            for key, seconds in rows[:top]:
                print(f"    {key:48s} {seconds:8.3f} s {100 * seconds / total:5.1f} %")
            parts[name] = category_seconds(rows)
        for name, (products, attention) in parts.items():
            print(
                f"{precision} {name}: products {products:.2f} s, attention {attention:.2f} s, other {totals[name] - products - attention:.2f} s"
            )
        bound = totals["transformers"] / sum(parts["megacann"])
        print(
            f"{precision} ratio now {totals['transformers'] / totals['megacann']:.2f}x; bound {bound:.2f}x "
            "(transformers' total over megacann's products + attention)"
        )


if __name__ == "__main__":
    main()
