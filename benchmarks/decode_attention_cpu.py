#!/usr/bin/env python3
"""One decoding step's attention over a key/value cache on CPU: the reference (PyTorch's SDPA in the
cache's dtype), ``fp32_sdpa`` (bf16 / fp16 upcast to fp32 for the call) and the C++ kernel ``cpp`` (the
cache read as it lies, computed in fp32; when the library holds it).

    python benchmarks/decode_attention_cpu.py [--threads 1] [--batches 1 16] [--slots 128 255] [--repeats 30]
        [--dtypes fp32 bf16 fp16]

The shapes are those of benchmarks/generation_vs_transformers.py's model (8 query heads, 4 kv heads, head
dim 64) at the cache lengths of its first and last decoding step; the cache is a slice of a longer one, as
the generator hands it over. The two ways run in turn, ``--repeats`` rounds of 5 calls each; the best
round counts, and the ratios are of the same run (say the load: it is printed). The differences are the
largest absolute ones from the reference's output.
"""

from __future__ import annotations

import argparse
import os
import time

import bench_common  # noqa: F401 (puts the checkout on sys.path)
import torch

from megacann.ops import decode

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CALLS = 5


def per_call_ms(fn, args: tuple, kwargs: dict) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        fn(*args, **kwargs)
    return (time.perf_counter() - start) / CALLS * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--slots", type=int, nargs="+", default=[128, 255])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min); {args.threads} thread(s)")
    ways = {"reference": decode.decode_attention, "fp32_sdpa": decode.fp32_decode_attention}
    if decode._has_cpp_kernel():
        ways["cpp"] = decode.cpp_decode_attention
    names = list(ways)
    print(
        "dtype  batch  slots  "
        + "  ".join(f"{name} ms" for name in names)
        + "  "
        + "  ".join(f"reference/{name}" for name in names[1:])
        + "  "
        + "  ".join(f"max |{name} - reference|" for name in names[1:])
    )
    for dtype in (DTYPES[name] for name in args.dtypes):
        for batch in args.batches:
            for slots in args.slots:
                gen = torch.Generator().manual_seed(slots)
                q = torch.randn(batch, 1, HEADS, HEAD_DIM, generator=gen).to(dtype)
                k, v = (torch.randn(batch, slots + 64, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in "kv")
                mask = torch.rand(batch, 1, 1, slots, generator=gen) < 0.9
                mask[..., -1] = True
                call = ((q, k[:, :slots], v[:, :slots]), {"attn_mask": mask, "scale": HEAD_DIM**-0.5})
                best = dict.fromkeys(ways, float("inf"))
                with torch.no_grad():
                    outs = {name: fn(*call[0], **call[1]) for name, fn in ways.items()}  # warm-up
                    for _ in range(args.repeats):
                        for name, fn in ways.items():
                            best[name] = min(best[name], per_call_ms(fn, *call))
                ref = outs["reference"].float()
                print(
                    f"{str(dtype).removeprefix('torch.'):>8}  {batch:>5}  {slots:>5}  "
                    + "  ".join(f"{best[name]:>8.3f}" for name in names)
                    + "  "
                    + "  ".join(f"{best['reference'] / best[name]:>6.2f}" for name in names[1:])
                    + "  "
                    + "  ".join(f"{(outs[name].float() - ref).abs().max().item():.2e}" for name in names[1:]),
                    flush=True,
                )
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
