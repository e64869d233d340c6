"""Implementations of the mixture-of-experts ops (declared in :mod:`megacann.ops.signatures`): permuting
tokens by expert, the experts' grouped matmul, and the way back.

Three ops, each with a PyTorch reference that runs anywhere:

- ``moe_permute(tokens [T, h], expert_ids [T, k]) -> (permuted [T*k, h], row_id_map [T*k] int32)``: one
  copy of token ``t`` per chosen expert, rows grouped by expert id in ascending order (within an expert, in
  token order). ``row_id_map[t*k + j]`` is the row of ``permuted`` that holds token ``t``'s copy for its
  ``j``-th expert (the layout of ``torch_npu.npu_moe_token_permute``).
- ``grouped_matmul(x [N, in], weights, group_sizes) -> [N, out]``: the first ``group_sizes[0]`` rows of
  ``x`` times ``weights[0]ᵀ``, the next ``group_sizes[1]`` rows times ``weights[1]ᵀ``, … (each weight
  ``[out, in]``, as in ``F.linear``).
- ``moe_unpermute(permuted [T*k, h], row_id_map, probs [T, k]) -> [T, h]``: ``out[t] = Σ_j probs[t, j] ·
  permuted[row_id_map[t*k + j]]``; ``probs`` is cast to the tokens' dtype first (fp32 routing weights
  mixed with bf16 tokens have given NaN gradients in the NPU kernel).

Faster paths: torch_npu's ``npu_grouped_matmul`` / ``npu_moe_token_permute`` / ``npu_moe_token_unpermute``
on ``npu`` (imported lazily), and ``torch._grouped_mm`` on ``cuda`` (bf16) where it exists (on ``cpu``
only when pinned); shapes it cannot take fall back to the reference.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from megacann.accelerator import import_torch_npu
from megacann.ops import npu_api
from megacann.ops.registry import REFERENCE, register
from megacann.ops.weight_grad import active_store, defer_or_compute

# -- PyTorch reference ---------------------------------------------------------------------------------


@register("moe_permute", REFERENCE)
def _permute_reference(tokens: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top_k = expert_ids.shape[-1]
    order = torch.argsort(expert_ids.reshape(-1), stable=True)
    permuted = tokens.index_select(0, order // top_k)
    row_id_map = torch.empty_like(order, dtype=torch.int32)
    row_id_map[order] = torch.arange(order.numel(), dtype=torch.int32, device=order.device)
    return permuted, row_id_map


@register("moe_unpermute", REFERENCE)
def _unpermute_reference(
    permuted: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor, *, overwrite_input: bool = False
) -> torch.Tensor:
    num_tokens, top_k = probs.shape
    gathered = permuted.index_select(0, row_id_map).view(num_tokens, top_k, permuted.shape[-1])
    return torch.bmm(probs.to(permuted.dtype).unsqueeze(1), gathered).squeeze(1)


@register("grouped_matmul", REFERENCE)
def _grouped_matmul_reference(x: torch.Tensor, weights: list[torch.Tensor], group_sizes: list[int]) -> torch.Tensor:
    if not weights:
        raise ValueError("grouped_matmul needs at least one weight")
    outs = [F.linear(rows, w) for rows, w in zip(x.split(group_sizes), weights)]
    return torch.cat(outs)


# -- torch._grouped_mm (CUDA bf16; CPU when pinned) ----------------------------------------------------------------


_CPU_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_takes(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """``torch._grouped_mm`` needs 16-byte aligned rows; its CUDA kernels take bf16 only, its CPU path
    fp32, bf16 and fp16."""
    if x.dtype not in ((torch.bfloat16,) if x.device.type == "cuda" else _CPU_GROUPED_MM_DTYPES):
        return False
    if any(w.dtype != x.dtype for w in weights):
        return False
    size = x.element_size()
    return (x.shape[1] * size) % 16 == 0 and (weights[0].shape[0] * size) % 16 == 0


def _has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm(x, stack(weights)ᵀ)`` whose weights' gradient a split backward's B leaves to W
    (:mod:`megacann.ops.weight_grad`). The forward keeps its own small autograd graph of ``_grouped_mm``,
    and both gradients come from that graph's own backward (B asks it for the tokens' gradient, W for the
    weights'), so they equal autograd's bit for bit on every device; outside a split, one call asks for both."""

    @staticmethod
    def forward(ctx, x, offsets, *weights):
        stacked = torch.stack(weights).transpose(1, 2)  # [groups, in, out]; a copy of the weights per call
        with torch.enable_grad():
            x_in = x.detach().requires_grad_(ctx.needs_input_grad[0])
            w_in = stacked.requires_grad_()
            out = torch._grouped_mm(x_in, w_in, offs=offsets)
        ctx.inner, ctx.weights = (out, x_in, w_in), weights
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        (out, x_in, w_in), weights = ctx.inner, ctx.weights
        ctx.inner = ctx.weights = None  # the graph is freed by its last use
        grad = grad.contiguous()  # (the stride-0 gradient of e.g. ``.sum()`` is not taken)
        need_x, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[2:])
        if need_w and active_store() is None:  # not split: both gradients in one call, as autograd runs it
            grads = torch.autograd.grad(out, [x_in, w_in] if need_x else [w_in], grad)
            return (grads[0] if need_x else None, None, *(grads[-1][i].t() for i in range(len(weights))))
        grad_x = torch.autograd.grad(out, [x_in], grad, retain_graph=need_w)[0] if need_x else None
        if not need_w:
            return (grad_x, None, *(None for _ in weights))

        def weight_grads() -> list:
            grad_w = torch.autograd.grad(out, [w_in], grad)[0]  # [groups, in, out]
            return [grad_w[i].t() for i in range(len(weights))]

        return (grad_x, None, *defer_or_compute(weights, weight_grads))


@register("grouped_matmul", "torch_grouped_mm", priority=10, device_types=("cuda",), available=_has_grouped_mm)
def _grouped_matmul_torch(x: torch.Tensor, weights: list[torch.Tensor], group_sizes: list[int]) -> torch.Tensor:
    if not _grouped_mm_takes(x, weights):
        return _grouped_matmul_reference(x, weights, group_sizes)
    offsets = torch.tensor(list(itertools.accumulate(group_sizes)), dtype=torch.int32, device=x.device)
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)
    return _GroupedMM.apply(x, offsets, *weights)


# On CPU torch's grouped matmul was not faster than the per-group loop here (benchmarks/moe_dispatch.py),
# so there it only serves when pinned (``ops.pin("grouped_matmul", "torch_grouped_mm_cpu")``).
@register("grouped_matmul", "torch_grouped_mm_cpu", priority=-1, device_types=("cpu",), available=_has_grouped_mm)
def _grouped_matmul_torch_cpu(x: torch.Tensor, weights: list[torch.Tensor], group_sizes: list[int]) -> torch.Tensor:
    return _grouped_matmul_torch(x, weights, group_sizes)


# -- torch_npu (Ascend) --------------------------------------------------------------------------------


def _torch_npu():
    return import_torch_npu()  # lazily, once; None without the CANN toolkit


def _npu_has(name: str) -> bool:
    npu = _torch_npu()
    return npu is not None and hasattr(npu, name)


GROUP_TYPE_2 = "npu_grouped_matmul(group_type=2)"  # the weight gradient's grouped product


class _NpuGroupedMatmul(torch.autograd.Function):
    """``npu_grouped_matmul`` forward and both backward products (input: split along M; weights: split
    along K with ``group_type=2``, or one product per expert where the build refuses that value).
    ``group_list`` holds the group sizes (``group_list_type=1``)."""

    @staticmethod
    def forward(ctx, x, group_list, *weights):
        ctx.save_for_backward(x, *weights)
        ctx.group_list, ctx.weights = group_list, weights
        gmm = _torch_npu().npu_grouped_matmul
        return gmm([x], [w.t() for w in weights], group_list=group_list, split_item=2, group_type=0, group_list_type=1)[
            0
        ]

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        gmm = _torch_npu().npu_grouped_matmul
        grad = grad.contiguous()
        group_list = ctx.group_list
        grad_x = gmm([grad], list(weights), group_list=group_list, split_item=2, group_type=0, group_list_type=1)[0]

        def weight_grads() -> list:  # [groups, in, out]: per group x_gᵀ · grad_g
            if not npu_api.was_refused(GROUP_TYPE_2):
                try:
                    grad_w = gmm([x.t()], [grad], group_list=group_list, split_item=3, group_type=2, group_list_type=1)
                    return [grad_w[0][i].t() for i in range(len(weights))]
                except RuntimeError as error:
                    if not npu_api.refused(GROUP_TYPE_2, error, "one product per expert"):
                        raise
            sizes = ctx.group_list.tolist()  # a build refusing group_type=2: grad_gᵀ · x_g, expert by expert
            return [g.t() @ rows for g, rows in zip(grad.split(sizes), x.split(sizes))]

        if not any(ctx.needs_input_grad[2:]):
            return (grad_x, None, *(None for _ in weights))
        # in a split backward's B, left to W (megacann.ops.weight_grad)
        return (grad_x, None, *defer_or_compute(ctx.weights, weight_grads))


@register(
    "grouped_matmul",
    "torch_npu",
    priority=20,
    device_types=("npu",),
    available=lambda: npu_api.supports("grouped_matmul", "torch_npu", "npu_grouped_matmul", "group_type"),
)
def _grouped_matmul_npu(x: torch.Tensor, weights: list[torch.Tensor], group_sizes: list[int]) -> torch.Tensor:
    group_list = torch.tensor(group_sizes, dtype=torch.int64, device=x.device)
    return _NpuGroupedMatmul.apply(x, group_list, *weights)


@register(
    "moe_permute",
    "torch_npu",
    priority=20,
    device_types=("npu",),
    available=lambda: _npu_has("npu_moe_token_permute"),
)
def _permute_npu(tokens: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    permuted, row_id_map = _torch_npu().npu_moe_token_permute(tokens, expert_ids)
    return permuted, row_id_map


@register(
    "moe_unpermute",
    "torch_npu",
    priority=20,
    device_types=("npu",),
    available=lambda: _npu_has("npu_moe_token_unpermute"),
)
def _unpermute_npu(
    permuted: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor, *, overwrite_input: bool = False
) -> torch.Tensor:
    return _torch_npu().npu_moe_token_unpermute(permuted, row_id_map.to(torch.int32), probs.to(permuted.dtype))
