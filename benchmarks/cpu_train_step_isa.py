"""The CPU train step against transformers (``cpu_train_step.py``) with PyTorch held to AVX2 and at the
machine's default, in one run, so an AVX-512 machine shows what an AVX2-only one would.

    python benchmarks/cpu_train_step_isa.py [--steps 2 --rounds 2 --precision fp32 bf16 ...]

Each setting runs ``cpu_train_step.py`` (its arguments passed on) in a process of its own:

- ``default``: whatever the machine offers (ATen's kernels, oneDNN and MKL pick AVX-512 where present);
- ``avx2``: ``ATEN_CPU_CAPABILITY=avx2`` (ATen's vectorised kernels), ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN:
  bf16 matmuls and more) and ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's fp32 GEMM), i.e. the ISA of an
  AVX2-only CPU such as the AMD EPYC the issue measured on.

megacann's C++ kernels run as built: the portable default build (no ``-march``: SSE2 loops on x86-64) is
the same binary in both settings. The two settings alternate ``--repeat`` times; both ratios printed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {
    "default": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="alternations of the two settings")
    args, passed = parser.parse_known_args()
    lines: dict[str, list[str]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeat):
        for name, env in SETTINGS.items():
            run = subprocess.run(
                [sys.executable, os.path.join(HERE, "cpu_train_step.py"), *passed],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                check=True,
            )
            rows = [line for line in run.stdout.splitlines() if re.match(r"(fp32|bf16): ", line)]
            lines[name] += rows
            print("\n".join(f"[{name}] {row}" for row in rows), flush=True)
    print("summary (megacann / transformers):")
    for name, rows in lines.items():
        ratios = [re.search(r"^(\w+):.*ratio ([\d.]+)x", row).groups() for row in rows]
        print(f"  {name:8s} " + ", ".join(f"{precision} {ratio}x" for precision, ratio in ratios))


if __name__ == "__main__":
    main()
