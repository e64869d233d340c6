"""Token dispatch: each token copy to the rank holding its expert, and the expert outputs back.

``dispatch(tokens [T, h], probs [T, k], expert_ids [T, k])`` returns the rows this rank's experts must
compute, grouped by local expert, and their counts; ``combine(expert_output, state)`` returns ``[T, h]``,
every token's expert outputs weighted by ``probs`` and summed. Steps:

1. permute: one copy of each token per chosen expert, sorted by expert (:func:`megacann.ops.moe_permute`).
   Assignments dropped by capacity carry the id ``num_experts`` and sort last; they are not sent and
   come back as zeros;
2. with expert parallelism (``ep > 1``; experts split in consecutive blocks, so sorting by expert also
   sorts by destination rank): exchange the per-expert counts (an all-to-all of ``ep × E/ep`` integers),
   then the tokens (``all_to_all_single`` with those split sizes), and regroup what arrived from
   (source rank, expert) order to (expert, source rank) order, so each local expert's rows are contiguous;
3. the caller computes the experts; ``combine`` reverses step 2 and unpermutes
   (:func:`megacann.ops.moe_unpermute`).

With ``ep == 1`` nothing is communicated. The exchange happens in the expert-parallel group; the
all-to-alls are autograd functions whose backward is the opposite all-to-all.

The token all-to-all of step 2 can overlap other work: :meth:`TokenDispatcher.start_dispatch` launches it
asynchronously and :meth:`TokenDispatcher.finish_dispatch` waits for it, so what runs between the two
(``MoELayer``: the shared experts) runs while the tokens travel. Backward overlaps alike: the gradients'
all-to-all is launched when it is reached and waited for only when the tokens' gradient is needed, so
autograd computes the nodes created in between (the shared experts' backward) meanwhile.

The dispatcher's steps read counts on the host and produce data-dependent shapes, so under
``torch.compile`` they run eagerly (``torch.compiler.disable``): the compiled graphs end before them and
resume after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megacann import ops
from megacann import parallel_state as ps
from megacann.layers.eager_regions import eager_under_compile


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; backward sends the gradients the opposite way."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


class _Pending:
    """An asynchronous all-to-all in flight: its work handle (forward), and backward's handle and output."""

    work: Optional[dist.Work] = None
    grad_work: Optional[dist.Work] = None
    grad: Optional[torch.Tensor] = None


class _AllToAllStart(torch.autograd.Function):
    """Launch ``all_to_all_single`` asynchronously; the output is filled once :class:`_AllToAllWait` has
    run. Backward waits for the gradients' all-to-all that :class:`_AllToAllWait`'s backward launched and
    returns what it brought."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, pending):
        ctx.pending = pending
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        pending.work = dist.all_to_all_single(
            out, x.contiguous(), output_splits, input_splits, group=group, async_op=True
        )
        return out

    @staticmethod
    def backward(ctx, _grad):
        pending = ctx.pending
        pending.grad_work.wait()
        grad, pending.grad_work, pending.grad = pending.grad, None, None
        return grad, None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    """Wait for :class:`_AllToAllStart`'s all-to-all (identity on its output). Backward launches the
    opposite all-to-all of the gradient asynchronously (for :class:`_AllToAllStart`'s backward to collect)."""

    @staticmethod
    def forward(ctx, out, output_splits, input_splits, group, pending):
        ctx.splits, ctx.group, ctx.pending = (output_splits, input_splits), group, pending
        pending.work.wait()
        pending.work = None
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        pending = ctx.pending
        pending.grad = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
        pending.grad_work = dist.all_to_all_single(
            pending.grad, grad.contiguous(), input_splits, output_splits, group=ctx.group, async_op=True
        )
        return grad, None, None, None, None


def _reorder_chunks(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """Split ``x`` into consecutive chunks of ``sizes`` rows and concatenate them in ``order``."""
    chunks = x.split(sizes)
    return torch.cat([chunks[i] for i in order])


@dataclass
class DispatchState:
    """What :meth:`TokenDispatcher.combine` needs from the matching :meth:`TokenDispatcher.dispatch`."""

    row_id_map: torch.Tensor
    probs: torch.Tensor
    num_kept: int  # permuted rows that went to an expert (dropped ones sort last)
    send_splits: Optional[list[int]] = None  # rows sent to each expert-parallel rank
    recv_splits: Optional[list[int]] = None  # rows received from each
    recv_counts: Optional[list[list[int]]] = None  # [source rank][local expert]


@dataclass
class PendingDispatch:
    """A dispatch started by :meth:`TokenDispatcher.start_dispatch`: ``tokens`` are the permuted rows (ep 1)
    or the all-to-all's output, valid only after :meth:`TokenDispatcher.finish_dispatch`."""

    tokens: torch.Tensor
    tokens_per_expert: list[int]
    state: DispatchState
    pending: Optional[_Pending] = None


class TokenDispatcher:
    """Moves token copies between this rank and the experts over ``group`` (default: the expert-parallel
    group of :mod:`megacann.parallel_state`); ``num_experts`` in all, ``num_experts / ep`` per rank."""

    def __init__(self, num_experts: int, group: Optional[dist.ProcessGroup] = None):
        self.group = group if group is not None else ps.get_expert_model_parallel_group()
        self.ep_size = dist.get_world_size(self.group) if self.group is not None else 1
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts {num_experts} is not divisible by expert_model_parallel_size {self.ep_size}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size

    @eager_under_compile
    def start_dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, expert_ids: torch.Tensor) -> PendingDispatch:
        """Permute and (``ep > 1``) launch the tokens' all-to-all; :meth:`finish_dispatch` completes it.
        ``expert_ids`` equal to ``num_experts`` mark dropped assignments."""
        permuted, row_id_map = ops.moe_permute(tokens, expert_ids)
        counts = torch.bincount(expert_ids.reshape(-1), minlength=self.num_experts + 1)
        num_kept = permuted.shape[0] - int(counts[self.num_experts])
        kept = permuted[:num_kept] if num_kept < permuted.shape[0] else permuted
        state = DispatchState(row_id_map, probs, num_kept)
        if self.ep_size == 1:
            return PendingDispatch(kept, counts[: self.num_experts].tolist(), state)
        send = counts[: self.num_experts].view(self.ep_size, self.num_local_experts)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        state.send_splits, state.recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        state.recv_counts = recv.tolist()
        pending = _Pending()
        in_flight = _AllToAllStart.apply(kept, state.recv_splits, state.send_splits, self.group, pending)
        return PendingDispatch(in_flight, recv.sum(0).tolist(), state, pending)

    @eager_under_compile
    def finish_dispatch(self, started: PendingDispatch) -> tuple[torch.Tensor, list[int], DispatchState]:
        """Wait for the tokens of :meth:`start_dispatch`: ``(expert_input [N, h], tokens_per_local_expert,
        state)``, the rows grouped by local expert."""
        received, state = started.tokens, started.state
        if started.pending is None:
            return received, started.tokens_per_expert, state
        received = _AllToAllWait.apply(received, state.recv_splits, state.send_splits, self.group, started.pending)
        if self.num_local_experts > 1:  # (source, expert) -> (expert, source)
            order = [s * self.num_local_experts + e for e in range(self.num_local_experts) for s in range(self.ep_size)]
            sizes = [n for row in state.recv_counts for n in row]
            received = _reorder_chunks(received, sizes, order)
        return received, started.tokens_per_expert, state

    def dispatch(
        self, tokens: torch.Tensor, probs: torch.Tensor, expert_ids: torch.Tensor
    ) -> tuple[torch.Tensor, list[int], DispatchState]:
        """:meth:`start_dispatch` then :meth:`finish_dispatch`, with nothing in between."""
        return self.finish_dispatch(self.start_dispatch(tokens, probs, expert_ids))

    @eager_under_compile
    def combine(
        self, expert_output: torch.Tensor, state: DispatchState, *, expert_output_unused_after: bool = False
    ) -> torch.Tensor:
        """Return the expert outputs to their tokens' ranks and sum each token's, weighted: ``[T, h]``.
        ``expert_output_unused_after``: nothing else reads ``expert_output`` (the caller made it and drops
        it), so the backward may write its gradient over it; the dispatcher's own intermediates (all-to-all,
        reordering, dropped rows) are always reused so."""
        out = expert_output
        if self.ep_size > 1:
            if self.num_local_experts > 1:  # (expert, source) -> (source, expert)
                sizes = [state.recv_counts[s][e] for e in range(self.num_local_experts) for s in range(self.ep_size)]
                order = [e * self.ep_size + s for s in range(self.ep_size) for e in range(self.num_local_experts)]
                out = _reorder_chunks(out, sizes, order)
            out = _AllToAll.apply(out, state.send_splits, state.recv_splits, self.group)
        dropped = state.row_id_map.numel() - state.num_kept
        if dropped:
            out = torch.cat([out, out.new_zeros((dropped,) + tuple(out.shape[1:]))])
        private = expert_output_unused_after or out is not expert_output
        return ops.moe_unpermute(out, state.row_id_map, state.probs, overwrite_input=private)
