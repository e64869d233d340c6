"""Dequantising one block-scaled fp8 weight (DeepSeek-V3's 128 x 128 blocks): megacann's in-place product
(:func:`megacann.interop.quantized.dequantize_blocks`) against the plain product with a weight-sized scale
tensor gathered per element, at DeepSeek-V3's shapes. Prints time per weight and the peak memory over the fp8
input of each (a fresh process per measurement, ``ru_maxrss``), as ratios.

    python benchmarks/fp8_dequant.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import bench_common  # noqa: F401  (puts the checkout on sys.path)

SHAPES = {"expert": (2048, 7168), "dense MLP": (18432, 7168), "kv_a_proj_with_mqa": (576, 7168)}
BLOCK = (128, 128)

CHILD = """
import json, math, resource, sys, time, torch
from megacann.interop.quantized import dequantize_blocks
rows, cols, variant, repeats = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
weight = torch.empty(rows, cols, dtype=torch.uint8).random_(0, 120).view(torch.float8_e4m3fn)
scale = torch.rand(math.ceil(rows / 128), math.ceil(cols / 128))
def gather():
    r, c = torch.arange(rows) // 128, torch.arange(cols) // 128
    return weight.to(torch.float32) * scale[r][:, c]
run = (lambda: dequantize_blocks(weight, scale, (128, 128))) if variant == "megacann" else gather
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = run()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
del out
start = time.perf_counter()
for _ in range(repeats):
    out = run()
    del out
print(json.dumps({"s": (time.perf_counter() - start) / repeats, "peak_mib": peak / 1024}))
"""


def measure(shape: tuple[int, int], variant: str, repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([bench_common.ROOT, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", CHILD, str(shape[0]), str(shape[1]), variant, str(repeats)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| weight | shape | megacann ms | gather ms | time ratio | megacann MiB | gather MiB | fp32 MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        ours, plain = measure(shape, "megacann", args.repeats), measure(shape, "gather", args.repeats)
        fp32 = math.prod(shape) * 4 / 2**20
        print(
            f"| {name} | {shape[0]} x {shape[1]} | {ours['s'] * 1e3:.0f} | {plain['s'] * 1e3:.0f} | "
            f"{ours['s'] / plain['s']:.2f} | {ours['peak_mib']:.0f} | {plain['peak_mib']:.0f} | {fp32:.0f} |"
        )


if __name__ == "__main__":
    main()
