"""Make every gradient final after backward: tensor-parallel partial sums, tied embeddings, data parallel."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable

import torch

from megacann import parallel_state as ps
from megacann.collectives import all_reduce_coalesced
from megacann.layers.mappings import sync_partial_grads
from megacann.layers.sharding import SHARED_EMBEDDING_ATTR, is_duplicate

# Parameters tied across pipeline stages (the word embedding used by the first and last stage) carry
# SHARED_EMBEDDING_ATTR (set by megacann.layers.sharding.mark_tied_across_stages); their gradients are
# summed over the embedding group. In the V placement of zbv and dualpipev both ends of the tie sit on
# stage 0, in its two chunks: that rank sums them itself (:func:`sum_tied_within_rank`).
__all__ = ["SHARED_EMBEDDING_ATTR", "finalize_model_grads", "reduce_shared_embedding_grads", "sum_tied_within_rank"]


GradOf = Callable[[torch.nn.Parameter], torch.Tensor]


def _main_grad(param: torch.nn.Parameter) -> torch.Tensor:
    return param.main_grad


def sum_tied_within_rank(grads: list[torch.Tensor]) -> None:
    """Give each of a tied parameter's gradients held on one rank (the original's and its copies') their
    sum, in place: what the one parameter of a single process accumulates from all its uses."""
    if len(grads) < 2:
        return
    total = grads[0].clone()
    for grad in grads[1:]:
        total.add_(grad)
    for grad in grads:
        grad.copy_(total)


def reduce_shared_embedding_grads(params: Iterable[torch.nn.Parameter], grad_of: GradOf = _main_grad) -> None:
    """Sum the gradients of embeddings tied between the first and last pipeline stage: over the embedding
    group, or on the one rank that holds both the original and its copies (stage 0 of a V placement, where
    the last stage holds neither and so takes part in no sum)."""
    if ps.get_pipeline_model_parallel_world_size() == 1 or not ps.is_rank_in_embedding_group():
        return
    shared = [p for p in params if p.requires_grad and getattr(p, SHARED_EMBEDDING_ATTR, False)]
    if any(is_duplicate(p) for p in shared) and not all(is_duplicate(p) for p in shared):
        sum_tied_within_rank([grad_of(p) for p in shared])
        return
    all_reduce_coalesced([grad_of(p) for p in shared], ps.get_embedding_group())


def finalize_model_grads(params: list[torch.nn.Parameter], grad_sync) -> None:
    """Run every reduction a step needs before the optimizer may read the gradients.

    ``grad_sync`` is the data-parallel reduction (:class:`GradBuffers`, all-reduce or ZeRO reduce-scatter).
    It runs first, as with ``overlap_grad_reduce`` it may have started during backward; the sums over the
    tensor-parallel and embedding groups then apply to whatever part of each reduced gradient this rank
    holds (``grad_sync.reduced_grad``). Sums commute, so the order changes only rounding. With ZeRO the
    parts agree across those groups: TP ranks share one buffer layout, and tied embeddings sit in a bucket
    of their own on both pipeline stages.
    """
    grad_sync.finish_grad_sync()
    sync_partial_grads(params, grad_of=grad_sync.reduced_grad)  # sums over TP of partly computed gradients
    reduce_shared_embedding_grads(params, grad_sync.reduced_grad)
