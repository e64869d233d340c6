#!/usr/bin/env python3
"""One decoding step's attention over a key/value cache on CPU: the reference (PyTorch's SDPA in the
cache's dtype) against megacann's CPU route ``fp32_sdpa`` (bf16 / fp16 upcast to fp32 for the call).

    python benchmarks/decode_attention_cpu.py [--threads 1] [--batches 1 16] [--slots 128 255] [--repeats 30]

The shapes are those of benchmarks/generation_vs_transformers.py's model (8 query heads, 4 kv heads, head
dim 64) at the cache lengths of its first and last decoding step; the cache is a slice of a longer one, as
the generator hands it over. The two ways run in turn, ``--repeats`` rounds of 5 calls each; the best
round counts, and the ratio is of the same run (say the load: it is printed).
"""

from __future__ import annotations

import argparse
import os
import time

import bench_common  # noqa: F401 (puts the checkout on sys.path)
import torch

from megacann.ops import decode

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min); {args.threads} thread(s)")
    print("dtype  batch  slots  reference ms  fp32_sdpa ms  ratio  max |difference|")
    ways = {"reference": decode.decode_attention, "fp32_sdpa": decode.fp32_decode_attention}
    for dtype in (torch.float32, torch.bfloat16):
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
                difference = (outs["reference"].float() - outs["fp32_sdpa"].float()).abs().max().item()
                print(
                    f"{str(dtype).removeprefix('torch.'):>8}  {batch:>5}  {slots:>5}  {best['reference']:>12.3f}  "
                    f"{best['fp32_sdpa']:>12.3f}  {best['reference'] / best['fp32_sdpa']:>5.2f}  {difference:.2e}",
                    flush=True,
                )
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
