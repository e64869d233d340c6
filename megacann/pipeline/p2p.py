"""Point-to-point transfers between adjacent pipeline stages: activations forward, their gradients back.

Every transfer of a schedule step goes through :func:`exchange`, which posts the step's sends and receives
as single (unbatched) ``isend``/``irecv`` calls in a fixed order and then waits for all of them:

    even stages: send to next, receive from previous, send to previous, receive from next
    odd stages:  receive from previous, send to next, receive from next, send to previous

On every link the upstream stage therefore sends its activation before it receives the gradient, and the
downstream stage receives the activation before it sends the gradient, so the operations of the two
ends pair up in the same order whichever stage is even or odd (also across the wrap-around from the last
stage to the first that the interleaved schedule uses). That is what backends that run one pair's
operations in issue order (NCCL, HCCL) need, and gloo needs no batching (``batch_isend_irecv`` has hung
there). No tags are used, so gloo matches messages exactly as NCCL does and a test on CPU checks the
order a cluster will see.

Shapes are known ahead (:func:`activation_shape`): ``[micro_batch, seq_length / cp (/ tp under sequence
parallelism), hidden]``, in the dtype of the model's parameters; a tensor of another shape or dtype is an
error naming both, never a silent mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.pipeline.timeline import Timeline

EVEN_ORDER = ("send_next", "recv_prev", "send_prev", "recv_next")
ODD_ORDER = ("recv_prev", "send_next", "recv_next", "send_prev")


def activation_shape(
    micro_batch: int,
    seq_length: int,
    hidden_size: int,
    sequence_parallel: bool = False,
    tp_size: int = 1,
    cp_size: int = 1,
) -> tuple[int, int, int]:
    """The shape of the hidden states passed between stages: ``[b, s / cp (/ tp under SP), h]`` (this rank's
    share of the sequence under context parallelism, and its shard of that under sequence parallelism)."""
    if seq_length % cp_size:
        raise ValueError(
            f"context parallelism splits seq_length {seq_length} over context_parallel_size {cp_size}: "
            "it must be divisible"
        )
    local = seq_length // cp_size
    if sequence_parallel and tp_size > 1:
        if local % tp_size:
            what = f"seq_length {seq_length}" + (f" / context_parallel_size {cp_size}" if cp_size > 1 else "")
            raise ValueError(
                f"sequence parallelism splits {what} over tensor_parallel_size {tp_size}: it must be divisible"
            )
        local //= tp_size
    return (micro_batch, local, hidden_size)


def _neighbours() -> tuple[int, int]:
    """Global ranks of the previous and next stage of this rank's pipeline (wrapping around)."""
    ranks = ps.get_pipeline_model_parallel_ranks()
    stage = ps.get_pipeline_model_parallel_rank()
    return ranks[(stage - 1) % len(ranks)], ranks[(stage + 1) % len(ranks)]


def _check(tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise ValueError(
            f"pipeline stage {ps.get_pipeline_model_parallel_rank()}: {what} has shape {list(tensor.shape)} and "
            f"dtype {tensor.dtype}, the schedule expects {list(shape)} and {dtype} "
            "(micro-batch x seq_length / context_parallel_size [/ tp under sequence parallelism] x hidden, "
            "in the parameters' dtype)"
        )
    return tensor.detach().contiguous()


def exchange(
    *,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    send_next: Optional[torch.Tensor] = None,
    send_prev: Optional[torch.Tensor] = None,
    recv_prev: bool = False,
    recv_next: bool = False,
    timeline: Optional[Timeline] = None,
    posted: Optional[list] = None,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One schedule step's transfers; returns (tensor from the previous stage, tensor from the next).

    ``send_next`` is an activation for the next stage, ``send_prev`` a gradient for the previous one;
    ``recv_prev`` asks for an activation from the previous stage, ``recv_next`` for a gradient from the
    next one. Blocks until every transfer is done. ``posted``, a list, receives the name of each transfer
    (``send_next``, ``recv_prev``, ``send_prev``, ``recv_next``) as it is posted.
    """
    prev_rank, next_rank = _neighbours()
    group = ps.get_pipeline_model_parallel_group()
    from_prev = torch.empty(shape, dtype=dtype, device=device) if recv_prev else None
    from_next = torch.empty(shape, dtype=dtype, device=device) if recv_next else None
    to_next = _check(send_next, shape, dtype, "the activation to send") if send_next is not None else None
    to_prev = _check(send_prev, shape, dtype, "the gradient to send") if send_prev is not None else None

    # (is a receive, tensor, peer) in this stage's fixed order; absent transfers are skipped
    transfers = {
        "send_next": (False, to_next, next_rank),
        "recv_prev": (True, from_prev, prev_rank),
        "send_prev": (False, to_prev, prev_rank),
        "recv_next": (True, from_next, next_rank),
    }
    order = EVEN_ORDER if ps.get_pipeline_model_parallel_rank() % 2 == 0 else ODD_ORDER
    receives, sends = [], []
    for name in order:
        is_recv, tensor, peer = transfers[name]
        if tensor is None:
            continue
        if posted is not None:
            posted.append(name)
        if is_recv:
            receives.append(dist.irecv(tensor, peer, group=group))
        else:
            sends.append(dist.isend(tensor, peer, group=group))
    for kind, pending in (("recv_wait", receives), ("send_wait", sends)):
        if pending:
            with Timeline.span_of(timeline, kind):
                for work in pending:
                    work.wait()
    return from_prev, from_next


def exchange_in_order(
    transfers: Sequence[tuple[object, int, Optional[torch.Tensor]]],
    *,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    timeline: Optional[Timeline] = None,
    posted: Optional[list] = None,
) -> list[Optional[torch.Tensor]]:
    """Transfers posted in exactly the order given, then all waited for: the V-shaped schedules' steps,
    whose links carry tensors both ways (:mod:`megacann.pipeline.v_schedules` fixes an order both ends of a
    link share). Each transfer is ``(name, peer, tensor)``: ``peer`` +1 for the next stage, -1 for the
    previous (no wrap-around), ``tensor`` what to send, or None to receive one. ``posted`` receives each
    name as its transfer is posted. Returns the received tensors in order (None for a send)."""
    ranks = ps.get_pipeline_model_parallel_ranks()
    stage = ps.get_pipeline_model_parallel_rank()
    group = ps.get_pipeline_model_parallel_group()
    received: list[Optional[torch.Tensor]] = []
    receives, sends = [], []
    for name, peer, tensor in transfers:
        if not 0 <= stage + peer < len(ranks):
            raise ValueError(f"pipeline stage {stage}: {name} goes to stage {stage + peer}, which does not exist")
        rank = ranks[stage + peer]
        if posted is not None:
            posted.append(name)
        if tensor is None:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            receives.append(dist.irecv(buffer, rank, group=group))
            received.append(buffer)
        else:
            outgoing = _check(tensor, shape, dtype, f"{name}'s tensor")  # kept alive until sent
            sends.append((dist.isend(outgoing, rank, group=group), outgoing))
            received.append(None)
    for kind, pending in (("recv_wait", receives), ("send_wait", [work for work, _ in sends])):
        if pending:
            with Timeline.span_of(timeline, kind):
                for work in pending:
                    work.wait()
    return received
