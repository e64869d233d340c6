"""The executor of pipeline plans: :func:`run_plan` runs one stage's list of actions in order.

A model chunk runs through the model family's ``forward_step`` (the model contract,
:mod:`megacann.models.spec`); what its backward starts from is
:func:`megacann.models.step_loss.backward_objective`: each micro-batch's token-loss sum divided by
``loss_normalizer`` (the target tokens of the whole global batch), plus its auxiliary losses weighted by
1 / (micro-batches x data-parallel x context-parallel ranks), times the loss scale. Micro-batches come whole;
under context parallelism the executor hands the model this cp rank's share of each. Each model chunk's
last backward of the step runs inside ``grad_sync_context()`` when the caller hands one (the optimizer's
:meth:`~megacann.optimizer.OptimizerBase.last_micro_batch_backward`, as Megatron hands its schedules
``grad_sync_func``), so gradient reductions may overlap it; without one they all run when the step's
gradients are finalised. ``trace=[]`` records what the executor really ran, in order: each compute action
and each point-to-point transfer by the name p2p posted it under (tests compare it with the plan).
The plans themselves come from :mod:`megacann.pipeline.plan` and the schedules that pick them from
:mod:`megacann.pipeline.schedules`.
"""

from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Optional, TypedDict

import torch

from megacann import parallel_state as ps
from megacann.layers.context_parallel import context_parallel_batch
from megacann.models.contract import LossTotals, aux_loss_weight, backward_objective
from megacann.models.spec import decoder_forward_step
from megacann.pipeline import p2p
from megacann.pipeline.overlap import run_pair
from megacann.pipeline.plan import Action, Backward, BackwardInput, BackwardWeight, Exchange, Forward
from megacann.pipeline.split_backward import backward_input, backward_weight, trainable_parameters
from megacann.pipeline.timeline import Timeline
from megacann.pipeline.v_schedules import ACTIVATION, GRADIENT, VExchange, v_is_model_last, v_local_handoff

ForwardStep = Callable[[torch.nn.Module, dict, Optional[torch.Tensor]], object]
GradSyncContext = Callable[[], AbstractContextManager]


class StepOptions(TypedDict, total=False):
    """The keywords of :func:`run_plan` that every schedule hands it unchanged (same names, same defaults)."""

    loss_scale: float
    forward_step: ForwardStep
    timeline: Optional[Timeline]
    grad_sync_context: Optional[GradSyncContext]
    trace: Optional[list]


class _Queues:
    """Tensors of one stage between actions: received inputs and output gradients, and saved forwards,
    per chunk, oldest first; the latest output and input gradient waiting to be sent."""

    def __init__(self, num_chunks: int):
        self.inputs: list[deque] = [deque() for _ in range(num_chunks)]
        self.grads: list[deque] = [deque() for _ in range(num_chunks)]
        self.saved: list[deque] = [deque() for _ in range(num_chunks)]
        self.weights: list[deque] = [deque() for _ in range(num_chunks)]  # B run, W not yet
        self.to_next: Optional[torch.Tensor] = None
        self.to_prev: Optional[torch.Tensor] = None
        self.outbox: dict[tuple[str, int], deque] = {}  # V placement: (kind, chunk) -> made, not yet sent

    def take(self, queue: deque, what: str, chunk: int) -> torch.Tensor:
        if not queue:
            raise RuntimeError(f"pipeline schedule: no {what} for model chunk {chunk} (a plan bug)")
        return queue.popleft()

    def leftovers(self) -> int:
        queues = self.inputs + self.grads + self.saved + self.weights + list(self.outbox.values())
        return sum(len(q) for q in queues)


def run_plan(
    plan: list[Action],
    model_chunks: list[torch.nn.Module],
    micro_batches: list[dict],
    *,
    loss_normalizer: float,
    loss_scale: float = 1.0,
    forward_only: bool = False,
    forward_step: ForwardStep = decoder_forward_step,
    tensor_shape: Optional[tuple[int, ...]] = None,
    timeline: Optional[Timeline] = None,
    grad_sync_context: Optional[GradSyncContext] = None,
    trace: Optional[list] = None,
    v_shape: bool = False,
    overlap_pairs: Optional[dict] = None,
    probe: Optional[list] = None,
) -> LossTotals:
    """Execute one stage's plan; returns this rank's loss totals.

    ``micro_batches`` hold whole sequences; under context parallelism each is cut to this cp rank's share
    (:func:`~megacann.layers.context_parallel_batch`: tokens, labels, position ids of the whole sequence,
    segment ids) before the model sees it.

    ``tensor_shape`` is the shape of the activations passed between stages (needed when the plan has
    transfers); they travel in the dtype of the model's parameters.

    ``grad_sync_context()`` wraps each model chunk's last backward (or W) of the step: its gradients become
    final there, so the optimizer's buffers may start reducing them (``optimizer.last_micro_batch_backward``).

    ``trace``, a list, receives every action as it runs: the compute actions themselves and, for an
    Exchange, the names of its transfers (``send_next``, ``recv_prev``, ...) in the order they were posted
    (for a V exchange, its :class:`~megacann.pipeline.v_schedules.Transfer` entries).

    ``v_shape``: the two chunks of this stage sit in the V of :mod:`megacann.pipeline.v_schedules`
    (``zbv``, ``dualpipev``): the loss is on stage 0's chunk 1, the last stage hands chunk 0's output to
    its chunk 1 (and chunk 1's input gradient back to chunk 0) in place, detached as a transfer would;
    each chunk's actions run on its communication lane (:func:`megacann.parallel_state.communication_lane`).

    ``overlap_pairs`` (forward -> backward, :func:`~megacann.pipeline.v_schedules.dualpipev_pairs`): where the
    plan lists such a forward followed by its backward, the two run at once, the backward on a second thread
    (:func:`~megacann.pipeline.overlap.run_pair`; the trace lists them in plan order), except a backward
    that runs inside ``grad_sync_context``. ``probe``, a list, receives (action, thread id, start, end) of
    every action of a pair that ran at once.
    """
    stages, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    num_chunks = len(model_chunks)
    param = next(model_chunks[0].parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    totals = LossTotals(
        device,
        aux_weight=aux_loss_weight(len(micro_batches), ps.get_data_parallel_world_size(with_context_parallel=True)),
    )
    micro_batches = [context_parallel_batch(batch) for batch in micro_batches]  # this cp rank's tokens
    queues = _Queues(num_chunks)
    virtual = num_chunks > 1
    chunk_params = [trainable_parameters(chunk) for chunk in model_chunks]
    saved_virtual_rank = ps.get_virtual_pipeline_model_parallel_rank()
    last_backward = {a.chunk: a for a in plan if isinstance(a, (Backward, BackwardWeight))}  # grads final there
    pairs = {f: b for f, b in (overlap_pairs or {}).items() if isinstance(b, Backward) and f.chunk != b.chunk}

    def model_first(chunk: int) -> bool:
        return stage == 0 and chunk == 0

    def model_last(chunk: int) -> bool:
        if v_shape:
            return v_is_model_last(stage, chunk)
        return stage == stages - 1 and chunk == num_chunks - 1

    def hand_over(kind: str, chunk: int, tensor: torch.Tensor) -> None:
        """V placement: a chunk's output or input gradient, to its outbox or in place to the other chunk."""
        if v_local_handoff(stages, stage, chunk, kind):
            activation = kind == ACTIVATION
            queue = queues.inputs[1] if activation else queues.grads[0]
            queue.append(tensor.detach().requires_grad_(activation and not forward_only))
        else:
            queues.outbox.setdefault((kind, chunk), deque()).append(tensor)

    def forward(action: Forward) -> None:
        c = action.chunk
        x = None if model_first(c) else queues.take(queues.inputs[c], "received activation", c)
        with Timeline.span_of(timeline, "forward"), torch.set_grad_enabled(not forward_only):
            out = forward_step(model_chunks[c], micro_batches[action.micro_batch], x)
            expected = "token_loss" if model_last(c) else "hidden_states"
            if getattr(out, expected, None) is None:
                raise RuntimeError(
                    f"model chunk {c} returned no {expected}: the model's forward_step must return a ChunkOutput "
                    "with hidden_states from a chunk without the head and token_loss from the last chunk"
                )
            totals.add(out)
            objective = (
                None
                if forward_only
                else backward_objective(
                    out, normalizer=loss_normalizer, aux_weight=totals.aux_weight, loss_scale=loss_scale
                )
            )
        if v_shape and not model_last(c):
            hand_over(ACTIVATION, c, out.hidden_states)
        elif not model_last(c):
            queues.to_next = out.hidden_states
        if not forward_only:
            queues.saved[c].append((x, None if model_last(c) else out.hidden_states, objective))

    def backward_start(c: int) -> tuple:
        """(chunk input, outputs, their gradients) of the oldest forward of chunk ``c`` awaiting its backward."""
        x, hidden, objective = queues.take(queues.saved[c], "saved forward", c)
        outputs, grads = [], []
        if hidden is not None:
            outputs.append(hidden)
            grads.append(queues.take(queues.grads[c], "received gradient", c))
        if objective is not None:
            outputs.append(objective)
            grads.append(None)
        return x, outputs, grads

    def in_sync(action: Action) -> bool:
        return grad_sync_context is not None and action == last_backward[action.chunk]

    def sync_of(action: Action) -> AbstractContextManager:
        return grad_sync_context() if in_sync(action) else nullcontext()

    def overlapped(f: Forward, b: Backward) -> None:
        """A pair at once: ``b``'s autograd pass on a worker thread, ``f`` here, each on its chunk's lane."""
        x, outputs, grads = backward_start(b.chunk)

        def back() -> None:
            with ps.communication_lane(b.chunk), Timeline.span_of(timeline, "backward"):
                torch.autograd.backward(outputs, grad_tensors=grads)

        def fwd() -> None:
            with ps.communication_lane(f.chunk):
                forward(f)

        run_pair(fwd, back, (f, b), probe)
        give_gradient(b.chunk, x.grad if x is not None else None)

    def backward(action: Backward) -> None:
        x, outputs, grads = backward_start(action.chunk)
        with Timeline.span_of(timeline, "backward"), sync_of(action):
            torch.autograd.backward(outputs, grad_tensors=grads)
        give_gradient(action.chunk, x.grad if x is not None else None)

    def give_gradient(chunk: int, gradient: Optional[torch.Tensor]) -> None:
        if v_shape and gradient is not None:
            hand_over(GRADIENT, chunk, gradient)
        else:
            queues.to_prev = gradient

    def backward_b(action: BackwardInput) -> None:
        x, outputs, grads = backward_start(action.chunk)
        with Timeline.span_of(timeline, "backward"):
            give_gradient(action.chunk, backward_input(outputs, grads, [x])[0] if x is not None else None)
        queues.weights[action.chunk].append((outputs, grads))

    def backward_w(action: BackwardWeight) -> None:
        c = action.chunk
        outputs, grads = queues.take(queues.weights[c], "input gradient (B) run before this W", c)
        with Timeline.span_of(timeline, "weight"), sync_of(action):
            backward_weight(outputs, grads, chunk_params[c])

    def transfer(action: Exchange) -> None:
        if tensor_shape is None:
            raise ValueError("a pipeline schedule needs tensor_shape (p2p.activation_shape) to transfer activations")
        send_next = queues.to_next if action.send_forward else None
        send_prev = queues.to_prev if action.send_backward else None
        if (action.send_forward and send_next is None) or (action.send_backward and send_prev is None):
            raise RuntimeError(f"pipeline schedule: {action} has nothing to send (a plan bug)")
        activation, gradient = p2p.exchange(
            shape=tensor_shape,
            dtype=dtype,
            device=device,
            send_next=send_next,
            send_prev=send_prev,
            recv_prev=action.recv_forward is not None,
            recv_next=action.recv_backward is not None,
            timeline=timeline,
            posted=trace,
        )
        if action.send_forward:
            queues.to_next = None
        if action.send_backward:
            queues.to_prev = None
        if activation is not None:
            queues.inputs[action.recv_forward].append(activation.requires_grad_(not forward_only))
        if gradient is not None:
            queues.grads[action.recv_backward].append(gradient)

    def v_transfer(action: VExchange) -> None:
        if tensor_shape is None:
            raise ValueError("a pipeline schedule needs tensor_shape (p2p.activation_shape) to transfer activations")
        ops = []
        for tr in action.transfers:
            box = queues.outbox.setdefault((tr.kind, tr.chunk), deque())
            ops.append((tr, tr.peer, queues.take(box, f"{tr.kind} to send", tr.chunk) if tr.send else None))
        received = p2p.exchange_in_order(
            ops, shape=tensor_shape, dtype=dtype, device=device, timeline=timeline, posted=trace
        )
        for tr, got in zip(action.transfers, received):
            if got is not None and tr.kind == ACTIVATION:
                queues.inputs[tr.chunk].append(got.requires_grad_(not forward_only))
            elif got is not None:
                queues.grads[tr.chunk].append(got)

    compute = {Forward: forward, Backward: backward, BackwardInput: backward_b, BackwardWeight: backward_w}
    try:
        with Timeline.run_of(timeline):
            index = 0
            while index < len(plan):
                action, index = plan[index], index + 1
                if isinstance(action, Exchange):
                    transfer(action)
                    continue
                if isinstance(action, VExchange):
                    v_transfer(action)
                    continue
                if virtual:
                    ps.set_virtual_pipeline_model_parallel_rank(action.chunk)
                partner = pairs.get(action)
                if partner is not None and index < len(plan) and plan[index] == partner and not in_sync(partner):
                    overlapped(action, partner)
                    index += 1
                    if trace is not None:
                        trace += [action, partner]
                    continue
                with ps.communication_lane(action.chunk if v_shape else 0):
                    compute[type(action)](action)
                if trace is not None:
                    trace.append(action)
    finally:
        if virtual and saved_virtual_rank is not None:
            ps.set_virtual_pipeline_model_parallel_rank(saved_virtual_rank)
    if queues.leftovers():
        raise RuntimeError(f"pipeline schedule: {queues.leftovers()} tensors left unused at the end (a plan bug)")
    return totals
