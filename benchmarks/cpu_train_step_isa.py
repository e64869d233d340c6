"""The CPU train step against transformers (``cpu_train_step.py``) under several instruction sets in one
run, so an AVX-512 machine shows what an AVX2-only one would, and what each variant of megacann's C++
kernel loops gives.

    python benchmarks/cpu_train_step_isa.py [--repeat 2] [--settings default avx2 ...] [--steps 1 --rounds 2 ...]

Each setting runs ``cpu_train_step.py`` (the other arguments passed on) in a process of its own:

- ``default``: whatever the machine offers (ATen, oneDNN and MKL pick AVX-512 where present; megacann's
  kernels their best variant, :mod:`megacann.ops.isa`);
- ``avx2``: an AVX2-only CPU emulated for the whole process: ``ATEN_CPU_CAPABILITY=avx2`` (ATen's
  vectorised kernels, and so megacann's kernels, which never go above PyTorch's capability),
  ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN: bf16 matmuls and more), ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's
  fp32 GEMM), ``MEGACANN_CPU_ISA=avx2``;
- ``avx2-baseline``: the same with megacann's portable baseline loops (``MEGACANN_CPU_ISA=baseline``: what
  a portable build ran before the variants existed);
- ``default-baseline``: the machine's default with the baseline loops;
- ``avx2-bf16-native``: ``avx2`` with bf16 matmuls left to PyTorch (``MEGACANN_CPU_BF16_MATMUL=bf16``), where
  ``avx2`` runs them as fp32 GEMMs (:mod:`megacann.ops.bf16_matmul`: oneDNN held to AVX2 has no bf16 GEMM).

The settings alternate ``--repeat`` times; the summary gives each ratio's median and range.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
SETTINGS = {
    "default": {},
    "avx2": {**AVX2, "MEGACANN_CPU_ISA": "avx2"},
    "avx2-baseline": {**AVX2, "MEGACANN_CPU_ISA": "baseline"},
    "default-baseline": {"MEGACANN_CPU_ISA": "baseline"},
    "avx2-bf16-native": {**AVX2, "MEGACANN_CPU_ISA": "avx2", "MEGACANN_CPU_BF16_MATMUL": "bf16"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="alternations of the settings")
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=["default", "avx2", "avx2-baseline"])
    args, passed = parser.parse_known_args()
    ratios: dict[str, dict[str, list[float]]] = {name: {} for name in args.settings}
    for _ in range(args.repeat):
        for name in args.settings:
            run = subprocess.run(
                [sys.executable, os.path.join(HERE, "cpu_train_step.py"), *passed],
                env={**os.environ, **SETTINGS[name]},
                capture_output=True,
                text=True,
                check=True,
            )
            rows = [line for line in run.stdout.splitlines() if re.match(r"(fp32|bf16): ", line)]
            for row in rows:
                precision, ratio = re.search(r"^(\w+):.*ratio ([\d.]+)x", row).groups()
                ratios[name].setdefault(precision, []).append(float(ratio))
            print("\n".join(f"[{name}] {row}" for row in rows), flush=True)
    print("summary (megacann / transformers: median [min-max] of the repeats):")
    for name, by_precision in ratios.items():
        cells = [
            f"{precision} {statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]"
            for precision, r in by_precision.items()
        ]
        print(f"  {name:17s} " + ", ".join(cells))


if __name__ == "__main__":
    main()
