"""The executor of pipeline plans: :class:`PlanRunner` runs one stage's list of actions in order, one method
per kind of action; :func:`run_plan` builds one and runs it.

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
from megacann.pipeline.actions import (
    ACTIVATION,
    GRADIENT,
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Exchange,
    Forward,
    VExchange,
)
from megacann.pipeline.overlap import run_pair
from megacann.pipeline.placement import LOOP, Placement
from megacann.pipeline.split_backward import backward_input, backward_weight, trainable_parameters
from megacann.pipeline.timeline import Timeline

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
    per chunk, oldest first; outputs and input gradients made and not yet sent, per (kind, chunk)."""

    def __init__(self, num_chunks: int):
        self.inputs: list[deque] = [deque() for _ in range(num_chunks)]
        self.grads: list[deque] = [deque() for _ in range(num_chunks)]
        self.saved: list[deque] = [deque() for _ in range(num_chunks)]
        self.weights: list[deque] = [deque() for _ in range(num_chunks)]  # B run, W not yet
        self.outbox: dict[tuple[str, int], deque] = {}  # (kind, chunk) -> made, not yet sent
        self.latest: dict[str, int] = {}  # kind -> the chunk that made the latest one (what an Exchange sends)

    def take(self, queue: deque, what: str, chunk: int) -> torch.Tensor:
        if not queue:
            raise RuntimeError(f"pipeline schedule: no {what} for model chunk {chunk} (a plan bug)")
        return queue.popleft()

    def box(self, kind: str, chunk: int) -> deque:
        return self.outbox.setdefault((kind, chunk), deque())

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
    placement: Placement = LOOP,
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
    (for a V exchange, its :class:`~megacann.pipeline.actions.Transfer` entries).

    ``placement`` (the schedule's, :mod:`megacann.pipeline.placement`) says which chunk holds the loss,
    which outputs stay on the stage (the V's last stage hands chunk 0's output to its chunk 1, and chunk
    1's input gradient back to chunk 0, in place, detached as a transfer would) and on which communication
    lane each chunk's actions run (:func:`megacann.parallel_state.communication_lane`).

    ``overlap_pairs`` (forward -> backward, the schedule's ``pairs``): where the plan lists such a forward
    followed by its backward, the two run at once, the backward on a second thread
    (:func:`~megacann.pipeline.overlap.run_pair`; the trace lists them in plan order), except a backward
    that runs inside ``grad_sync_context``. ``probe``, a list, receives (action, thread id, start, end) of
    every action of a pair that ran at once.
    """
    runner = PlanRunner(
        model_chunks,
        micro_batches,
        loss_normalizer=loss_normalizer,
        loss_scale=loss_scale,
        forward_only=forward_only,
        forward_step=forward_step,
        tensor_shape=tensor_shape,
        timeline=timeline,
        grad_sync_context=grad_sync_context,
        trace=trace,
        placement=placement,
        probe=probe,
    )
    return runner.run(plan, overlap_pairs or {})


class PlanRunner:
    """One stage's model chunks and micro-batches, and what passes between the actions of its plan: one
    method per kind of action (the keywords are :func:`run_plan`'s)."""

    def __init__(
        self,
        model_chunks: list[torch.nn.Module],
        micro_batches: list[dict],
        *,
        loss_normalizer: float,
        loss_scale: float,
        forward_only: bool,
        forward_step: ForwardStep,
        tensor_shape: Optional[tuple[int, ...]],
        timeline: Optional[Timeline],
        grad_sync_context: Optional[GradSyncContext],
        trace: Optional[list],
        placement: Placement,
        probe: Optional[list],
    ):
        self.stages, self.stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        self.chunks = model_chunks
        param = next(model_chunks[0].parameters(), None)
        self.dtype = param.dtype if param is not None else torch.float32
        self.device = param.device if param is not None else torch.device("cpu")
        data_ranks = ps.get_data_parallel_world_size(with_context_parallel=True)
        self.totals = LossTotals(self.device, aux_weight=aux_loss_weight(len(micro_batches), data_ranks))
        self.micro_batches = [context_parallel_batch(batch) for batch in micro_batches]  # this cp rank's tokens
        self.loss_normalizer, self.loss_scale, self.forward_only = loss_normalizer, loss_scale, forward_only
        self.forward_step, self.tensor_shape, self.timeline = forward_step, tensor_shape, timeline
        self.grad_sync_context, self.trace, self.placement, self.probe = grad_sync_context, trace, placement, probe
        self.queues = _Queues(len(model_chunks))
        self.chunk_params = [trainable_parameters(chunk) for chunk in model_chunks]
        self.last_backward: dict[int, Action] = {}  # per chunk: the backward (or W) whose gradients are final

    def run(self, plan: list[Action], overlap_pairs: dict) -> LossTotals:
        """Run ``plan`` in order (a pair of ``overlap_pairs`` listed back to back runs at once)."""
        self.last_backward = {a.chunk: a for a in plan if isinstance(a, (Backward, BackwardWeight))}
        pairs = {f: b for f, b in overlap_pairs.items() if isinstance(b, Backward) and f.chunk != b.chunk}
        handlers = {
            Forward: self.forward,
            Backward: self.backward,
            BackwardInput: self.backward_input,
            BackwardWeight: self.backward_weight,
            Exchange: self.exchange,
            VExchange: self.v_exchange,
        }
        virtual = len(self.chunks) > 1
        saved_virtual_rank = ps.get_virtual_pipeline_model_parallel_rank()
        try:
            with Timeline.run_of(self.timeline):
                index = 0
                while index < len(plan):
                    action, index = plan[index], index + 1
                    if isinstance(action, (Exchange, VExchange)):
                        handlers[type(action)](action)
                        continue
                    if virtual:
                        ps.set_virtual_pipeline_model_parallel_rank(action.chunk)
                    partner = pairs.get(action)
                    if (
                        partner is not None
                        and index < len(plan)
                        and plan[index] == partner
                        and not self.in_sync(partner)
                    ):
                        self.overlapped(action, partner)
                        index += 1
                        self._traced(action, partner)
                        continue
                    with ps.communication_lane(self.placement.lane(action.chunk)):
                        handlers[type(action)](action)
                    self._traced(action)
        finally:
            if virtual and saved_virtual_rank is not None:
                ps.set_virtual_pipeline_model_parallel_rank(saved_virtual_rank)
        leftovers = self.queues.leftovers()
        if leftovers:
            raise RuntimeError(f"pipeline schedule: {leftovers} tensors left unused at the end (a plan bug)")
        return self.totals

    def _traced(self, *actions: Action) -> None:
        if self.trace is not None:
            self.trace.extend(actions)

    def is_model_last(self, chunk: int) -> bool:
        return self.placement.is_model_last(self.stages, self.stage, chunk, len(self.chunks))

    def made(self, kind: str, chunk: int, tensor: torch.Tensor) -> None:
        """A chunk's output or input gradient: to be sent, or handed to the other chunk in place."""
        if self.placement.local_handoff(self.stages, self.stage, chunk, kind):
            activation = kind == ACTIVATION
            queue = self.queues.inputs[1 - chunk] if activation else self.queues.grads[1 - chunk]
            queue.append(tensor.detach().requires_grad_(activation and not self.forward_only))
        else:
            self.queues.box(kind, chunk).append(tensor)
            self.queues.latest[kind] = chunk

    def forward(self, action: Forward) -> None:
        c, q = action.chunk, self.queues
        x = None if self.placement.is_model_first(self.stage, c) else q.take(q.inputs[c], "received activation", c)
        last = self.is_model_last(c)
        with Timeline.span_of(self.timeline, "forward"), torch.set_grad_enabled(not self.forward_only):
            out = self.forward_step(self.chunks[c], self.micro_batches[action.micro_batch], x)
            expected = "token_loss" if last else "hidden_states"
            if getattr(out, expected, None) is None:
                raise RuntimeError(
                    f"model chunk {c} returned no {expected}: the model's forward_step must return a ChunkOutput "
                    "with hidden_states from a chunk without the head and token_loss from the last chunk"
                )
            self.totals.add(out)
            objective = None
            if not self.forward_only:
                objective = backward_objective(
                    out, normalizer=self.loss_normalizer, aux_weight=self.totals.aux_weight, loss_scale=self.loss_scale
                )
        if not last:
            self.made(ACTIVATION, c, out.hidden_states)
        if not self.forward_only:
            q.saved[c].append((x, None if last else out.hidden_states, objective))

    def backward_start(self, c: int) -> tuple:
        """(chunk input, outputs, their gradients) of the oldest forward of chunk ``c`` awaiting its backward.

        An output that nothing trainable made is left out (its gradient received and dropped): with frozen
        weights before it (e.g. DeepSeek-V3.2's indexer warm-up, whose indexers read detached inputs) a
        stage's hidden states carry no graph, and the stage backs up its own losses alone."""
        q = self.queues
        x, hidden, objective = q.take(q.saved[c], "saved forward", c)
        outputs, grads = [], []
        if hidden is not None:
            grad = q.take(q.grads[c], "received gradient", c)
            if hidden.requires_grad:
                outputs.append(hidden)
                grads.append(grad)
        if objective is not None and objective.requires_grad:
            outputs.append(objective)
            grads.append(None)
        return x, outputs, grads

    def in_sync(self, action: Action) -> bool:
        """The action is its chunk's last backward (or W) of the step and runs inside grad_sync_context."""
        return self.grad_sync_context is not None and action == self.last_backward[action.chunk]

    def sync_of(self, action: Action) -> AbstractContextManager:
        return self.grad_sync_context() if self.in_sync(action) else nullcontext()

    def give_gradient(self, chunk: int, gradient: Optional[torch.Tensor]) -> None:
        if gradient is not None:  # none on the model's first chunk
            self.made(GRADIENT, chunk, gradient)

    def backward(self, action: Backward) -> None:
        x, outputs, grads = self.backward_start(action.chunk)
        with Timeline.span_of(self.timeline, "backward"), self.sync_of(action):
            torch.autograd.backward(outputs, grad_tensors=grads)
        self.give_gradient(action.chunk, x.grad if x is not None else None)

    def backward_input(self, action: BackwardInput) -> None:
        x, outputs, grads = self.backward_start(action.chunk)
        with Timeline.span_of(self.timeline, "backward"):
            self.give_gradient(action.chunk, backward_input(outputs, grads, [x])[0] if x is not None else None)
        self.queues.weights[action.chunk].append((outputs, grads))

    def backward_weight(self, action: BackwardWeight) -> None:
        c, q = action.chunk, self.queues
        outputs, grads = q.take(q.weights[c], "input gradient (B) run before this W", c)
        with Timeline.span_of(self.timeline, "weight"), self.sync_of(action):
            backward_weight(outputs, grads, self.chunk_params[c])

    def overlapped(self, f: Forward, b: Backward) -> None:
        """A pair at once: ``b``'s autograd pass on a worker thread, ``f`` here, each on its chunk's lane."""
        x, outputs, grads = self.backward_start(b.chunk)

        def back() -> None:
            with ps.communication_lane(self.placement.lane(b.chunk)), Timeline.span_of(self.timeline, "backward"):
                torch.autograd.backward(outputs, grad_tensors=grads)

        def fwd() -> None:
            with ps.communication_lane(self.placement.lane(f.chunk)):
                self.forward(f)

        run_pair(fwd, back, (f, b), self.probe)
        self.give_gradient(b.chunk, x.grad if x is not None else None)

    def _shape(self) -> tuple[int, ...]:
        if self.tensor_shape is None:
            raise ValueError("a pipeline schedule needs tensor_shape (p2p.activation_shape) to transfer activations")
        return self.tensor_shape

    def _latest(self, kind: str, action: Action) -> torch.Tensor:
        """What an Exchange sends: the oldest unsent result of the chunk that made the latest ``kind``."""
        box = self.queues.box(kind, self.queues.latest.get(kind, -1))
        if not box:
            raise RuntimeError(f"pipeline schedule: {action} has nothing to send (a plan bug)")
        return box.popleft()

    def exchange(self, action: Exchange) -> None:
        """The loop placement's transfers with both neighbours."""
        shape = self._shape()
        send_next = self._latest(ACTIVATION, action) if action.send_forward else None
        send_prev = self._latest(GRADIENT, action) if action.send_backward else None
        activation, gradient = p2p.exchange(
            shape=shape,
            dtype=self.dtype,
            device=self.device,
            send_next=send_next,
            send_prev=send_prev,
            recv_prev=action.recv_forward is not None,
            recv_next=action.recv_backward is not None,
            timeline=self.timeline,
            posted=self.trace,
        )
        if activation is not None:
            self.queues.inputs[action.recv_forward].append(activation.requires_grad_(not self.forward_only))
        if gradient is not None:
            self.queues.grads[action.recv_backward].append(gradient)

    def v_exchange(self, action: VExchange) -> None:
        """The V placement's transfers, each naming its peer, kind and chunk, posted in the plan's order."""
        shape, q = self._shape(), self.queues
        ops = []
        for tr in action.transfers:
            tensor = q.take(q.box(tr.kind, tr.chunk), f"{tr.kind} to send", tr.chunk) if tr.send else None
            ops.append((tr, tr.peer, tensor))
        received = p2p.exchange_in_order(
            ops, shape=shape, dtype=self.dtype, device=self.device, timeline=self.timeline, posted=self.trace
        )
        for tr, got in zip(action.transfers, received):
            if got is not None and tr.kind == ACTIVATION:
                q.inputs[tr.chunk].append(got.requires_grad_(not self.forward_only))
            elif got is not None:
                q.grads[tr.chunk].append(got)
