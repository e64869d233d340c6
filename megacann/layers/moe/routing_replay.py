"""Recording and replaying the experts a model's routers choose (router replay).

A reinforcement-learning step trains on rollouts the model generated; a MoE policy's training forward can
route a token to other experts than the rollout's forward did (other batch, kernels, weights after an
update), which makes the two policies differ more than their weights do. Router replay records the
rollout's choices and makes the training forward reuse them: the router still computes its scores, and
the chosen experts' gate weights are its scores of the replayed experts (only the choice is replaced).

Both work through :attr:`~megacann.layers.moe.router.TopKRouter.choice_hook` on each router of a module
tree, in module order (:func:`routers`), so any model built from :class:`~megacann.layers.moe.MoELayer`
can use them. A recording holds the rows each router routed in a forward (``[b * s]`` tokens, sequence
after sequence); a replay is given per router ``[b, s, k]`` ids for the sequence as the MoE layer's input
holds it (this context-parallel rank's share), and under tensor parallelism, where each rank routes its
contiguous ``s / tp`` slice, each router takes its rank's slice. A block that full activation
checkpointing recomputes in backward, after the replay's block has closed, replays the same choices
(:func:`~megacann.layers.random.recomputed_inside`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from megacann.layers import mappings
from megacann.layers.moe.router import TopKRouter
from megacann.layers.random import recomputed_inside


def routers(model: torch.nn.Module) -> list[TopKRouter]:
    """The model's routers in module order (the order recordings and replays are matched by)."""
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


@contextlib.contextmanager
def _hooked(model: torch.nn.Module, hook) -> Iterator[list[TopKRouter]]:
    found = routers(model)
    held = [router.choice_hook for router in found]
    for router in found:
        router.choice_hook = hook
    try:
        yield found
    finally:
        for router, previous in zip(found, held):
            router.choice_hook = previous


@contextlib.contextmanager
def routing_recorded(model: torch.nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Inside the block every forward of each router appends its chosen ids ``[T, k]`` (int64, detached) to
    that router's list; yields the lists, one per router of :func:`routers`."""
    found = routers(model)
    recorded: list[list[torch.Tensor]] = [[] for _ in found]
    index = {id(router): i for i, router in enumerate(found)}

    def record(router: TopKRouter, expert_ids: torch.Tensor) -> torch.Tensor:
        recorded[index[id(router)]].append(expert_ids.detach().clone())
        return expert_ids

    with _hooked(model, record):
        yield recorded


def _routed_share(router: TopKRouter, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[b, s, ...]`` as ``router`` routes it: its tensor-parallel rank's slice of ``s``, flattened."""
    if router.tp_size > 1:
        x = x.chunk(router.tp_size, dim=1)[mappings.tp_rank(router.group)]
    return x.reshape(-1, *x.shape[2:])


@contextlib.contextmanager
def routing_replayed(model: torch.nn.Module, expert_ids: Sequence[torch.Tensor], mask: torch.Tensor) -> Iterator[None]:
    """Inside the block router ``j`` of :func:`routers` routes token ``(i, t)`` to ``expert_ids[j][i, t]``
    (``[b, s, k]``) where ``mask[i, t]`` (``[b, s]`` bool) is true, and to its own choice elsewhere."""
    found = routers(model)
    if len(expert_ids) != len(found):
        raise ValueError(f"routing replay: {len(expert_ids)} recorded routers for the {len(found)} of this model")
    index = {id(router): i for i, router in enumerate(found)}

    def replay(router: TopKRouter, chosen: torch.Tensor) -> torch.Tensor:
        recorded = _routed_share(router, expert_ids[index[id(router)]])
        where = _routed_share(router, mask)
        if recorded.shape != chosen.shape or where.shape != chosen.shape[:1]:
            raise ValueError(
                f"routing replay: the router routes {tuple(chosen.shape)} tokens x experts, the recording holds "
                f"{tuple(recorded.shape)} (mask {tuple(where.shape)})"
            )
        return torch.where(where.unsqueeze(-1), recorded.to(chosen), chosen)

    # a block recomputed in backward (full activation checkpointing) replays the same choices
    with _hooked(model, replay), recomputed_inside(lambda: _hooked(model, replay)):
        yield
