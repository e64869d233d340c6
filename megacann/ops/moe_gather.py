"""The experts' grouped matmul without concatenation (implementation ``gather``; the CPU and CUDA default
below the vendors' grouped kernels): each group's product writes into its rows of one output
(``out=``), forward and for the input's gradient, and each weight's gradient is one product. Here the
products are one ``torch.mm`` each; the ``cpp`` implementation (:mod:`megacann.ops.cpp`, the CPU default)
is the same autograd function with all products of a call in one C++ kernel.

The reference runs one ``F.linear`` per group and ``torch.cat``-s their outputs, which copies every
projection's output once forward and its gradient once backward (``cat`` took 4 % of the CPU time of
``benchmarks/moe_dispatch.py`` in a profile; the matmuls 80 %). Results equal the reference's (the same
products). On CPUs without native bf16 GEMM the bf16 products run as fp32 GEMMs, rounded to bf16
(:mod:`megacann.ops.bf16_matmul`). Permuting and unpermuting stay the reference's: backward by gathers instead of
``index_add_`` was measured slower on CPU (docs/moe.md, "Speed").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megacann.ops.bf16_matmul import gemm_dtype
from megacann.ops.registry import register
from megacann.ops.weight_grad import defer_or_compute

_DEVICES = ("cpu", "cuda")
_PRIORITY = 5  # above the reference (0), below the vendors' grouped kernels (10, 20)


def _row_slices(group_sizes: list[int]) -> list[slice]:
    """Each group's rows; ``None`` for a group without rows."""
    rows, start = [], 0
    for size in group_sizes:
        rows.append(slice(start, start + size) if size else None)
        start += size
    return rows


Products = Callable[[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]], None]


def mm_products(outs: list[torch.Tensor], lefts: list[torch.Tensor], rights: list[torch.Tensor]) -> None:
    """``outs[i] = lefts[i] @ rights[i]`` for every ``i`` (2-D, ``outs`` written in place), one ``torch.mm`` each."""
    for out, a, b in zip(outs, lefts, rights):
        torch.mm(a, b, out=out)


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_sizes, products, *weights):
        rows = _row_slices(group_sizes)
        mm = gemm_dtype(x, weights[0])  # fp32 on CPUs without bf16 GEMM (the copies transient)
        x_mm = x.to(mm)
        out = x.new_empty((x.shape[0], weights[0].shape[0]), dtype=mm)
        used = [i for i, r in enumerate(rows) if r]
        products([out[rows[i]] for i in used], [x_mm[rows[i]] for i in used], [weights[i].to(mm).t() for i in used])
        ctx.save_for_backward(x, *weights)
        ctx.rows, ctx.weights, ctx.products = rows, weights, products
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        mm = gemm_dtype(x, weights[0])
        grad = grad.contiguous().to(mm)
        grad_x = x.new_empty(x.shape, dtype=mm) if ctx.needs_input_grad[0] else None
        rows, products = ctx.rows, ctx.products
        used = [i for i, r in enumerate(rows) if r]
        if grad_x is not None:
            products([grad_x[rows[i]] for i in used], [grad[rows[i]] for i in used], [weights[i].to(mm) for i in used])
            grad_x = grad_x.to(x.dtype)
        wanted = [i for i in range(len(weights)) if ctx.needs_input_grad[3 + i]]

        def weight_grads() -> list:
            x_mm, computed = x.to(mm), [i for i in wanted if rows[i]]
            outs = [grad.new_empty(weights[i].shape) for i in computed]
            products(outs, [grad[rows[i]].t() for i in computed], [x_mm[rows[i]] for i in computed])
            grads = {i: g.to(weights[i].dtype) for i, g in zip(computed, outs)}
            return [grads[i] if i in grads else torch.zeros_like(weights[i]) for i in wanted]  # zeros: no rows

        grad_ws: list = [None] * len(weights)  # in a split backward's B, left to W (megacann.ops.weight_grad)
        if wanted:
            for i, g in zip(wanted, defer_or_compute([ctx.weights[i] for i in wanted], weight_grads)):
                grad_ws[i] = g
        return (grad_x, None, None, *grad_ws)


def grouped_matmul(
    x: torch.Tensor, weights: list[torch.Tensor], group_sizes: list[int], products: Products = mm_products
) -> torch.Tensor:
    """The grouped matmul with each call's products computed by ``products`` (shapes it does not take: the
    reference)."""
    if x.dim() != 2 or any(w.dim() != 2 or w.dtype != x.dtype for w in weights):
        from megacann.ops.moe import _grouped_matmul_reference

        return _grouped_matmul_reference(x, weights, group_sizes)
    return _GroupedMatmul.apply(x.contiguous(), list(group_sizes), products, *weights)


@register("grouped_matmul", "gather", priority=_PRIORITY, device_types=_DEVICES)
def _grouped_matmul_gather(x: torch.Tensor, weights: list[torch.Tensor], group_sizes: list[int]) -> torch.Tensor:
    return grouped_matmul(x, weights, group_sizes)
