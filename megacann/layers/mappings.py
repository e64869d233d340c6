"""Collectives over the tensor-parallel group as autograd functions (Megatron's "regions").

Activations are batch-first, ``[batch, seq, hidden]``; sequence parallelism splits dim 1 (``SEQUENCE_DIM``)
across the tensor-parallel ranks. Every function is the identity when the group has one rank, so layers
built on them run unchanged in a plain one-process script.

======================================================  ====================  ========================
function                                                forward               backward
======================================================  ====================  ========================
copy_to_tensor_model_parallel_region                    identity              all-reduce
reduce_from_tensor_model_parallel_region                all-reduce            identity
scatter_to_tensor_model_parallel_region                 split last dim        all-gather last dim
gather_from_tensor_model_parallel_region                all-gather last dim   split last dim
scatter_to_sequence_parallel_region                     split seq dim         all-gather seq dim
gather_from_sequence_parallel_region                    all-gather seq dim    reduce-scatter seq dim
reduce_scatter_to_sequence_parallel_region              reduce-scatter seq    all-gather seq dim
======================================================  ====================  ========================

The raw collectives underneath are :mod:`megacann.collectives` (flat all-gather / reduce-scatter with a
fallback where a backend lacks them). ``inplace=True`` lets an all-reduce overwrite its input (forward) or incoming
gradient (backward); layers pass it only for tensors nobody else reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.collectives import all_gather_flat, all_reduce_coalesced, reduce_scatter_flat
from megacann.layers.sharding import get_sharding

SEQUENCE_DIM = 1

Group = Optional[dist.ProcessGroup]


def tp_group(group: Group = None) -> Group:
    """``group`` if given, else the tensor-parallel group of :mod:`megacann.parallel_state` (None: one rank)."""
    return group if group is not None else ps.get_tensor_model_parallel_group()


def tp_world_size(group: Group = None) -> int:
    if group is not None:
        return dist.get_world_size(group)
    return ps.get_tensor_model_parallel_world_size()


def tp_rank(group: Group = None) -> int:
    if group is not None:
        return dist.get_rank(group)
    return ps.get_tensor_model_parallel_rank()


# -- raw collectives (no autograd) ---------------------------------------------------------------------


def _all_reduce(x: torch.Tensor, group: Group, inplace: bool) -> torch.Tensor:
    out = x if inplace else x.clone()
    dist.all_reduce(out, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    world = dist.get_world_size(group)
    size = x.shape[dim]
    if size % world:
        raise ValueError(f"cannot split dim {dim} of size {size} evenly across {world} tensor-parallel ranks")
    return x.narrow(dim, dist.get_rank(group) * (size // world), size // world).contiguous()


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (one copy when ``dim`` is not the leading one)."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    dim = dim % x.dim()
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out.view(-1), x.view(-1), group)
    if dim == 0:
        return out
    out = out.view((world,) + tuple(x.shape)).movedim(0, dim)
    shape = list(x.shape)
    shape[dim] *= world
    return out.reshape(shape)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's slice of ``dim``."""
    world = dist.get_world_size(group)
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % world:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {size} across {world} tensor-parallel ranks")
    local = size // world
    # stage rank-major: [world, ..., local, ...], contiguous (no copy when dim is leading or batch is 1);
    # flattened, as some backends check input.shape[0] == world * output.shape[0]
    shape = list(x.shape)
    shape[dim : dim + 1] = [world, local]
    staged = x.reshape(shape).movedim(dim, 0).contiguous()
    out = torch.empty(staged.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out.view(-1), staged.view(-1), group)  # ``staged`` is this function's own copy
    return out


# -- autograd functions --------------------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace):
        ctx.group, ctx.inplace = group, inplace
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.inplace), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace):
        out = _all_reduce(x, group, inplace)
        if inplace:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather forward; backward splits (replicated consumer) or reduce-scatters (sharded consumer)."""

    @staticmethod
    def forward(ctx, x, dim, group, reduce_grad):
        ctx.dim, ctx.group, ctx.reduce_grad = dim, group, reduce_grad
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


# -- public API ----------------------------------------------------------------------------------------


def _active(group: Group) -> tuple[bool, Group]:
    group = tp_group(group)
    return group is not None and dist.get_world_size(group) > 1, group


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Group = None, inplace: bool = False) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (input of a column-parallel layer)."""
    active, group = _active(group)
    return _CopyToRegion.apply(x, group, inplace) if active else x


def reduce_from_tensor_model_parallel_region(
    x: torch.Tensor, group: Group = None, inplace: bool = False
) -> torch.Tensor:
    """All-reduce forward; identity backward (output of a row-parallel layer)."""
    active, group = _active(group)
    return _ReduceFromRegion.apply(x, group, inplace) if active else x


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim; all-gather the gradient."""
    active, group = _active(group)
    return _ScatterToRegion.apply(x, -1, group) if active else x


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """All-gather along the last dim; the gradient is split back."""
    active, group = _active(group)
    return _GatherFromRegion.apply(x, -1, group, False) if active else x


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group = None, seq_dim: int = SEQUENCE_DIM):
    """Keep this rank's slice of the sequence; all-gather the gradient."""
    active, group = _active(group)
    return _ScatterToRegion.apply(x, seq_dim, group) if active else x


def gather_from_sequence_parallel_region(
    x: torch.Tensor,
    group: Group = None,
    tensor_parallel_output_grad: bool = True,
    seq_dim: int = SEQUENCE_DIM,
) -> torch.Tensor:
    """All-gather the sequence. Backward reduce-scatters (the consumer is tensor-parallel, each rank holds
    a partial gradient) or, with ``tensor_parallel_output_grad=False``, just splits it."""
    active, group = _active(group)
    return _GatherFromRegion.apply(x, seq_dim, group, tensor_parallel_output_grad) if active else x


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: Group = None, seq_dim: int = SEQUENCE_DIM
) -> torch.Tensor:
    """Sum over the ranks and keep this rank's slice of the sequence; all-gather the gradient."""
    active, group = _active(group)
    return _ReduceScatterToRegion.apply(x, seq_dim, group) if active else x


def sync_partial_grads(
    params: Iterable[torch.nn.Parameter],
    group: Group = None,
    grad_of: Callable[[torch.nn.Parameter], Optional[torch.Tensor]] = lambda p: p.grad,
) -> None:
    """Sum over the TP group the gradients of parameters marked ``tp_partial_grad`` (norm weights under
    sequence parallelism, replicated kv projections). A training loop calls this after backward; the
    megacann optimizer does it for you (on its fp32 gradients: ``grad_of``)."""
    active, group = _active(group)
    if not active:
        return
    grads = [grad_of(p) for p in params if p.requires_grad and get_sharding(p).tp_partial_grad]
    all_reduce_coalesced([g for g in grads if g is not None], group)
