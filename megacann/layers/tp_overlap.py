"""A sequence-parallel column-parallel projection whose collectives overlap its own matmuls
(``distributed.tp_comm_overlap``).

Without it, ``ColumnParallelLinear`` under sequence parallelism all-gathers the sequence, waits, then
multiplies; backward computes the input's and the weight's gradients and only then reduce-scatters the
input's. Here, in one autograd function:

- forward: the all-gather of the sequence shards is launched asynchronously, this rank's own rows are
  multiplied while the other ranks' shards travel, then the rest;
- backward: the input's gradient is computed first and its reduce-scatter launched asynchronously, the
  weight's gradient is computed while it runs, then the reduce-scatter is waited for (in a split
  backward's B the weight's gradient is left to W: :mod:`megacann.ops.weight_grad`).

The gathered input is kept rank-major (``[tp, b, s/tp, h]``: rank ``r``'s shard at ``[r]``), which is both
what a flat all-gather produces and what a flat reduce-scatter consumes, so neither direction copies
it; the output is reordered to ``[b, s, out]`` (a view when ``b == 1``). Results equal the plain path's
(the same products, the weight gradient summed over the same rows). Collectives that a backend runs
synchronously (a gloo without flat collectives) simply do not overlap.

On CPUs without native bf16 / fp16 GEMM every product (each chunk of the forward, the input and weight
gradients) runs as an fp32 GEMM rounded once, like ``ops.linear`` there (:mod:`megacann.ops.bf16_matmul`):
the collectives still move the model dtype, and the graph saves the low-precision tensors.

Under ``precision.fp8`` the products are FP8 ones (:class:`megacann.layers.fp8.Fp8GatheredProducts`): the
chunks' scales are agreed before the all-gather starts, so each chunk is quantised as the gathered whole.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.distributed as dist

from megacann.collectives import all_gather_flat, reduce_scatter_flat
from megacann.layers.eager_regions import eager_under_compile
from megacann.ops.bf16_matmul import gemm_dtype
from megacann.ops.weight_grad import active_store, defer_or_compute


class GatheredProducts(Protocol):
    """How the overlapped projection multiplies: plain matmuls (:class:`PlainProducts`) or FP8 products
    (:class:`megacann.layers.fp8.Fp8GatheredProducts`). One object serves one call, forward and backward."""

    def start(self, x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.dtype:
        """Before the all-gather: what every chunk's product shares; returns the products' result dtype."""

    def forward_rows(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """``rows @ weight.T`` (one chunk of the gathered input, ``[n, h]``) written into ``out``."""

    def input_grad(self, grad_rm: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The input's gradient ``grad_rm @ weight`` (rows rank-major, like the gathered input), in ``dtype``."""

    def prepare_weight_grad(self, grad_rm: torch.Tensor, gathered: torch.Tensor) -> None:
        """Before the input gradient's reduce-scatter, when the weight gradient follows at once (no split
        backward): whatever of it needs collectives of its own, so none queues behind the reduce-scatter."""

    def weight_grad(self, grad_rm: torch.Tensor, gathered: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The weight's gradient from the output gradient ``grad_rm`` (rows rank-major) and ``gathered``."""

    def bias_grad(self, grad_rm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The bias's gradient, in ``dtype``."""


class PlainProducts:
    """Matmuls in the model dtype; on CPUs without native bf16 / fp16 GEMM, fp32 GEMMs rounded once."""

    def start(self, x, weight, group):
        self.mm = gemm_dtype(x, weight)  # fp32 on CPUs without native bf16 / fp16 GEMM (the copies transient)
        self.weight_mm = weight.to(self.mm).t()
        return self.mm

    def forward_rows(self, rows, out):
        torch.mm(rows.to(self.mm), self.weight_mm, out=out)

    def input_grad(self, grad_rm, weight, dtype):
        return torch.mm(grad_rm.to(self.mm), weight.to(self.mm)).to(dtype)

    def prepare_weight_grad(self, grad_rm, gathered):  # plain matmuls need no collective
        pass

    def weight_grad(self, grad_rm, gathered, weight):  # upcasts here: a deferred closure holds the model dtype
        return grad_rm.to(self.mm).t().mm(gathered.view(-1, gathered.shape[-1]).to(self.mm)).to(weight.dtype)

    def bias_grad(self, grad_rm, dtype):
        return grad_rm.to(self.mm).sum(0).to(dtype)


class _OverlappedGatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, products):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        x = x.contiguous()
        b, s_local, h = x.shape
        out_dtype = products.start(x, weight, group)  # its own collectives (FP8 scales) before the gather's
        gathered = x.new_empty((world, b, s_local, h))
        work = all_gather_flat(gathered.view(-1), x.view(-1), group, async_op=True)
        out_features = weight.shape[0]
        y = x.new_empty((world, b * s_local, out_features), dtype=out_dtype)
        products.forward_rows(x.view(-1, h), y[rank])  # this rank's rows while the others' travel
        if work is not None:
            work.wait()
        for r in range(world):
            if r != rank:
                products.forward_rows(gathered[r].view(-1, h), y[r])
        if bias is not None:
            y += bias.to(out_dtype)
        y = y.to(x.dtype)  # rounded once on the fp32 route
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.has_bias, ctx.weight, ctx.products = group, bias is not None, weight, products
        # [tp, b, s/tp, out] -> [b, tp, s/tp, out] -> [b, s, out]
        return y.view(world, b, s_local, out_features).movedim(0, 1).reshape(b, world * s_local, out_features)

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        products = ctx.products
        world, b, s_local, h = gathered.shape
        out_features = weight.shape[0]
        grad_rm = grad.reshape(b, world, s_local, out_features).movedim(1, 0).contiguous().view(-1, out_features)
        grad_x = None
        work = None
        if ctx.needs_input_grad[0]:
            staged = products.input_grad(grad_rm, weight, gathered.dtype)  # [tp * b * s/tp, h]: rank-major
            if ctx.needs_input_grad[1] and active_store() is None:
                products.prepare_weight_grad(grad_rm, gathered)
            grad_x = staged.new_empty((b, s_local, h))
            work = reduce_scatter_flat(grad_x.view(-1), staged.view(-1), ctx.group, async_op=True)
        grad_w = None
        if ctx.needs_input_grad[1]:  # while it runs (or in W, after a split backward's B)

            def weight_grad() -> tuple[torch.Tensor]:
                return (products.weight_grad(grad_rm, gathered, weight),)

            (grad_w,) = defer_or_compute((ctx.weight,), weight_grad)
        grad_b = products.bias_grad(grad_rm, grad.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None, None


@eager_under_compile  # waits on work handles: runs eagerly under torch.compile (a graph break)
def overlapped_gather_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    group: dist.ProcessGroup,
    products: Optional[GatheredProducts] = None,
) -> torch.Tensor:
    """``F.linear(all_gather_sequence(x), weight, bias)`` for ``x`` ``[b, s/tp, h]`` with the all-gather
    overlapping this rank's rows' product, and in backward the input gradient's reduce-scatter
    overlapping the weight gradient's matmul. ``products``: how to multiply (plain matmuls by default).
    Returns ``[b, s, out]``."""
    return _OverlappedGatherLinear.apply(x, weight, bias, group, products or PlainProducts())
