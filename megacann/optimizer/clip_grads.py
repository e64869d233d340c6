"""Global gradient norm across every rank that holds part of the model, and clipping by it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.collectives import all_reduce_if_parallel
from megacann.layers.sharding import DUPLICATE_ATTR, get_sharding, is_duplicate

# A parameter that duplicates another rank's (the tied output embedding on the last pipeline stage)
# carries DUPLICATE_ATTR set to True and is left out of the norm so it is counted once.
__all__ = ["DUPLICATE_ATTR", "clip_grads_", "counts_toward_norm", "global_grad_norm"]


def counts_toward_norm(param: torch.nn.Parameter) -> bool:
    """Each gradient element is counted on exactly one rank of the tensor/pipeline grid."""
    if is_duplicate(param):
        return False
    return get_sharding(param).is_tensor_parallel or ps.get_tensor_model_parallel_rank() == 0


def _all_reduce_sum(value: torch.Tensor, groups: Iterable[Optional[dist.ProcessGroup]]) -> torch.Tensor:
    for group in groups:
        all_reduce_if_parallel(value, group)
    return value


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of the squared L2 norms of ``grads``, in fp32 (one multi-tensor kernel on CUDA)."""
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).pow(2).sum()


def global_grad_norm(
    params: Iterable[torch.nn.Parameter],
    grads: Optional[Iterable[torch.Tensor]] = None,
    sharded_over_data_parallel: bool = False,
    shard_groups: Optional[tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]] = None,
) -> torch.Tensor:
    """L2 norm of the gradients over the whole model (TP shards, pipeline stages and expert ranks), as a
    0-d fp32 tensor on the gradients' device: reading it (``float(norm)``) is the caller's choice, so a
    training step need not wait for the device here.

    ``grads`` are the gradients of ``params`` in the same order (default: each one's ``main_grad``). With
    ``sharded_over_data_parallel`` (ZeRO) every rank of the data-parallel x context-parallel group (the
    group gradients are reduced over) holds a disjoint part of each gradient, so the squared sums are first
    added over it (experts: the expert-data-parallel x context-parallel group); ``shard_groups`` (dense,
    expert) replace those groups under hybrid sharding, where a shard group holds each element once.
    """
    params = list(params)
    grads = [p.main_grad for p in params] if grads is None else list(grads)
    dense, expert = [], []
    for p, g in zip(params, grads):
        if p.requires_grad and counts_toward_norm(p):
            (expert if get_sharding(p).expert else dense).append(g)
    device = (dense or expert or grads or [torch.zeros(1)])[0].device
    sums = torch.zeros(2, dtype=torch.float32, device=device)
    if dense:
        sums[0] = _sum_of_squares(dense)
    if expert:
        sums[1] = _sum_of_squares(expert)
    if sharded_over_data_parallel:
        dense_group, expert_group = shard_groups or (
            ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_expert_data_parallel_group(with_context_parallel=True),
        )
        dense_sum = _all_reduce_sum(sums[:1].clone(), [dense_group])
        expert_sum = _all_reduce_sum(sums[1:].clone(), [expert_group])
        sums = torch.cat([dense_sum, expert_sum])
    _all_reduce_sum(sums, [ps.get_model_parallel_group()])
    if expert:  # expert shards differ across the expert-parallel group as well
        expert_sum = _all_reduce_sum(sums[1:].clone(), [ps.get_expert_model_parallel_group()])
        sums[1] = expert_sum[0]
    return sums.sum().sqrt()


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> Optional[torch.Tensor]:
    """Scale ``grads`` in place so their global norm is at most ``max_norm``; returns the factor used (a
    0-d tensor; 1 when the norm is within bounds or not finite), or None when clipping is off.

    Computed on the device, without reading the norm on the host: the factor is applied unconditionally
    (a multiply by 1 when no clipping is needed), the price of not synchronising inside the step."""
    if max_norm <= 0 or not grads:
        return None
    total_norm = torch.as_tensor(total_norm, dtype=torch.float32, device=grads[0].device)
    factor = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    factor = torch.where(torch.isfinite(total_norm), factor, torch.ones_like(factor))
    torch._foreach_mul_(grads, factor)
    return factor
