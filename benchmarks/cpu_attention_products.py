"""How much a hand-written CPU attention kernel could gain: ATen's flash attention (forward + backward, the
kernel megacann and transformers both use on CPU) against the bare block products such a kernel is built
from, in one run.

    python benchmarks/cpu_attention_products.py [--batch 8 --heads 8 --seq 512 --dim 64 --threads 2]

``flash``: causal ``F.scaled_dot_product_attention`` forward and backward (``4·b·h·s²·d / 2`` FLOPs forward,
2.5 times that backward). ``products``: the six matrix products of attention's forward and backward
(scores, output, and the four gradients) as full, non-causal ``torch.bmm`` calls with no softmax, i.e. a
kernel's GEMM work at twice the causal FLOPs. If the products alone run at R GFLOP/s, a kernel made of
them cannot beat R however well it fuses the rest; the ratio R / flash's effective rate bounds its gain.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_common import add_int_args


def median_seconds(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_int_args(parser, batch=8, heads=8, seq=512, dim=64, threads=2, repeats=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    b, h, s, d = args.batch, args.heads, args.seq, args.dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=gen).requires_grad_() for _ in range(3))
    qq, kk, vv = (t.detach().flatten(0, 1) for t in (q, k, v))

    def flash() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def products() -> None:
        scores = torch.bmm(qq, kk.transpose(1, 2))
        out = torch.bmm(scores, vv)
        grad_scores = torch.bmm(out, vv.transpose(1, 2))
        torch.bmm(scores.transpose(1, 2), out)  # value gradient
        torch.bmm(grad_scores, kk)  # query gradient
        torch.bmm(grad_scores.transpose(1, 2), qq)  # key gradient

    causal_flops = 4 * b * h * s * s * d / 2 * 3.5
    product_flops = 6 * 2 * b * h * s * s * d
    flash_s, products_s = median_seconds(flash, args.repeats), median_seconds(products, args.repeats)
    flash_rate, products_rate = causal_flops / flash_s / 1e9, product_flops / products_s / 1e9
    print(f"b {b}, heads {h}, seq {s}, dim {d}, fp32, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"  flash (causal, fwd + bwd)   {flash_s * 1e3:7.1f} ms  {flash_rate:6.1f} GFLOP/s effective")
    print(f"  six bmm products (full)     {products_s * 1e3:7.1f} ms  {products_rate:6.1f} GFLOP/s")
    print(f"  bound on a product-built kernel's gain over flash: {products_rate / flash_rate:.2f}x")


if __name__ == "__main__":
    main()
