"""Make every gradient final after backward: tensor-parallel partial sums, tied embeddings, data parallel."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable

import torch

from megacann import parallel_state as ps
from megacann.collectives import all_reduce_coalesced
from megacann.layers.mappings import sync_partial_grads
from megacann.layers.sharding import SHARED_EMBEDDING_ATTR

# Parameters tied across pipeline stages (the word embedding used by the first and last stage) carry
# SHARED_EMBEDDING_ATTR (set by megacann.layers.sharding.mark_tied_across_stages); their gradients are
# summed over the embedding group.
__all__ = ["SHARED_EMBEDDING_ATTR", "finalize_model_grads", "reduce_shared_embedding_grads"]


GradOf = Callable[[torch.nn.Parameter], torch.Tensor]


def _main_grad(param: torch.nn.Parameter) -> torch.Tensor:
    return param.main_grad


def reduce_shared_embedding_grads(params: Iterable[torch.nn.Parameter], grad_of: GradOf = _main_grad) -> None:
    """Sum the gradients of embeddings tied between the first and last pipeline stage."""
    if ps.get_pipeline_model_parallel_world_size() == 1 or not ps.is_rank_in_embedding_group():
        return
    grads = [grad_of(p) for p in params if p.requires_grad and getattr(p, SHARED_EMBEDDING_ATTR, False)]
    all_reduce_coalesced(grads, ps.get_embedding_group())


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
