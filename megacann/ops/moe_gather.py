"""The experts' grouped matmul without concatenation (implementation ``gather``; the CPU and CUDA default
below the vendors' grouped kernels): each group's ``torch.mm`` writes into its rows of one output
(``out=``), forward and for the input's gradient, and each weight's gradient is one ``mm``.

The reference runs one ``F.linear`` per group and ``torch.cat``-s their outputs, which copies every
projection's output once forward and its gradient once backward (``cat`` took 4 % of the CPU time of
``benchmarks/moe_dispatch.py`` in a profile; the matmuls 80 %). Results equal the reference's (the same
products). On CPUs without native bf16 GEMM the bf16 products run as fp32 GEMMs, rounded to bf16
(:mod:`megacann.ops.bf16_matmul`). Permuting and unpermuting stay the reference's: backward by gathers instead of
``index_add_`` was measured slower on CPU (docs/moe.md, "Speed").
"""

from __future__ import annotations

import torch

from megacann.ops.bf16_matmul import gemm_dtype
from megacann.ops.registry import register
from megacann.ops.weight_grad import defer_or_compute

_DEVICES = ("cpu", "cuda")
_PRIORITY = 5  # above the reference (0), below the vendors' grouped kernels (10, 20)


def _bounds(group_sizes: list[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in group_sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_sizes, *weights):
        bounds = _bounds(group_sizes)
        mm = gemm_dtype(x, weights[0])  # fp32 on CPUs without bf16 GEMM (the copies transient)
        x_mm = x.to(mm)
        out = x.new_empty((x.shape[0], weights[0].shape[0]), dtype=mm)
        for (start, end), w in zip(bounds, weights):
            if end > start:
                torch.mm(x_mm[start:end], w.to(mm).t(), out=out[start:end])
        ctx.save_for_backward(x, *weights)
        ctx.bounds, ctx.weights = bounds, weights
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        mm = gemm_dtype(x, weights[0])
        grad = grad.contiguous().to(mm)
        grad_x = x.new_empty(x.shape, dtype=mm) if ctx.needs_input_grad[0] else None
        if grad_x is not None:
            for (start, end), w in zip(ctx.bounds, weights):
                if end > start:
                    torch.mm(grad[start:end], w.to(mm), out=grad_x[start:end])
            grad_x = grad_x.to(x.dtype)
        wanted = [i for i in range(len(weights)) if ctx.needs_input_grad[2 + i]]
        bounds = ctx.bounds

        def weight_grads() -> list:
            x_mm = x.to(mm)
            return [
                grad[bounds[i][0] : bounds[i][1]].t().mm(x_mm[bounds[i][0] : bounds[i][1]]).to(weights[i].dtype)
                if bounds[i][1] > bounds[i][0]
                else torch.zeros_like(weights[i])
                for i in wanted
            ]

        grad_ws: list = [None] * len(weights)  # in a split backward's B, left to W (megacann.ops.weight_grad)
        if wanted:
            for i, g in zip(wanted, defer_or_compute([ctx.weights[i] for i in wanted], weight_grads)):
                grad_ws[i] = g
        return (grad_x, None, *grad_ws)


@register("grouped_matmul", "gather", priority=_PRIORITY, device_types=_DEVICES)
def _grouped_matmul_gather(x: torch.Tensor, weights: list[torch.Tensor], group_sizes: list[int]) -> torch.Tensor:
    if x.dim() != 2 or any(w.dim() != 2 or w.dtype != x.dtype for w in weights):
        from megacann.ops.moe import _grouped_matmul_reference

        return _grouped_matmul_reference(x, weights, group_sizes)
    return _GroupedMatmul.apply(x.contiguous(), list(group_sizes), *weights)
