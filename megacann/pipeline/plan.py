"""Schedules as plans: the exact sequence of forwards, backwards and transfers one pipeline stage runs.

A plan is a list of three kinds of action:

- ``Forward(chunk, micro_batch)``: run model chunk ``chunk`` on a micro-batch; its input is the oldest
  activation received for that chunk (none on the model's first chunk);
- ``Backward(chunk, micro_batch)``: back-propagate the oldest forward of that chunk; the gradient of its
  output is the oldest one received for that chunk (none on the model's last chunk, whose output is the loss);
- ``BackwardInput(chunk, micro_batch)`` and ``BackwardWeight(chunk, micro_batch)``: the two halves of a
  Backward that the zero-bubble schedules run apart: B computes only the gradient of the chunk's input
  (what the previous stage waits for), W later the gradients of the chunk's weights, oldest B first;
- ``Exchange``: one step's transfers (see :mod:`megacann.pipeline.p2p`): send the output of the latest
  Forward to the next stage, send the input gradient of the latest Backward to the previous stage,
  receive an activation for chunk ``recv_forward`` and/or a gradient for chunk ``recv_backward``.

Plans are pure functions of (stages, stage, virtual stages, micro-batches), so every rank can build any
rank's plan, and :mod:`megacann.pipeline.simulate` can check that all plans of a pipeline pair up without
deadlock, deliver every tensor where it belongs, and estimate the bubble. Model chunk ``c`` of stage ``s``
is model segment ``c * stages + s`` (see :func:`megacann.pipeline.partition.stage_layer_ids`); the V-shaped
schedules (:mod:`megacann.pipeline.v_schedules`) place chunk 1 of stage s at segment ``2 * stages - 1 - s``
and list their transfers in a ``VExchange`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from megacann.pipeline.rules import interleaved_schedule_error


@dataclass(frozen=True)
class Forward:
    chunk: int
    micro_batch: int


@dataclass(frozen=True)
class Backward:
    chunk: int
    micro_batch: int


@dataclass(frozen=True)
class BackwardInput:
    chunk: int
    micro_batch: int


@dataclass(frozen=True)
class BackwardWeight:
    chunk: int
    micro_batch: int


@dataclass(frozen=True)
class Exchange:
    send_forward: bool = False
    send_backward: bool = False
    recv_forward: Optional[int] = None  # chunk that the activation from the previous stage is for
    recv_backward: Optional[int] = None  # chunk that the gradient from the next stage is for


Action = Union[Forward, Backward, BackwardInput, BackwardWeight, Exchange]
Compute = (Forward, Backward, BackwardInput, BackwardWeight)


def _exchange(
    send_forward: bool = False,
    send_backward: bool = False,
    recv_forward: Optional[int] = None,
    recv_backward: Optional[int] = None,
) -> list[Action]:
    """An Exchange, or nothing when it would transfer nothing."""
    if not (send_forward or send_backward) and recv_forward is None and recv_backward is None:
        return []
    return [Exchange(send_forward, send_backward, recv_forward, recv_backward)]


def no_pipelining_plan(num_microbatches: int, forward_only: bool = False) -> list[Action]:
    """Gradient accumulation on one stage: forward and backward of each micro-batch in turn."""
    plan: list[Action] = []
    for i in range(num_microbatches):
        plan.append(Forward(0, i))
        if not forward_only:
            plan.append(Backward(0, i))
    return plan


def one_f_one_b_plan(
    stages: int, stage: int, num_microbatches: int, forward_only: bool = False, split_backward: bool = False
) -> list[Action]:
    """1F1B (PipeDream-Flush): stage s runs ``stages - s - 1`` warm-up forwards, then alternates one forward
    and one backward, then drains the remaining backwards. Works for any number of micro-batches (with
    fewer micro-batches than stages the warm-up is shorter and the bubble larger). ``split_backward``: each
    backward as B, and its W right after B's gradient is sent (ZB-H1, :mod:`megacann.pipeline.zero_bubble`)."""
    first, last = stage == 0, stage == stages - 1
    m = num_microbatches
    recv_input = None if first else 0
    plan: list[Action] = []
    if forward_only:
        for i in range(m):
            plan += _exchange(recv_forward=recv_input)
            plan.append(Forward(0, i))
            plan += _exchange(send_forward=not last)
        return plan

    def backward(j: int, then: list[Action]) -> None:
        """Micro-batch j's backward (or its B), the exchange ``then`` that sends its gradient, then its W."""
        plan.append(BackwardInput(0, j) if split_backward else Backward(0, j))
        plan.extend(then)
        if split_backward:
            plan.append(BackwardWeight(0, j))

    warmup = min(stages - stage - 1, m)
    steady = m - warmup
    for i in range(warmup):
        plan += _exchange(recv_forward=recv_input)
        plan.append(Forward(0, i))
        plan += _exchange(send_forward=not last)
    if steady:
        plan += _exchange(recv_forward=recv_input)
    for j in range(steady):
        plan.append(Forward(0, warmup + j))
        plan += _exchange(send_forward=not last, recv_backward=None if last else 0)
        more_forwards = j < steady - 1
        backward(j, _exchange(send_backward=not first, recv_forward=recv_input if more_forwards else None))
    for j in range(steady, m):
        plan += _exchange(recv_backward=None if last else 0)
        backward(j, _exchange(send_backward=not first))
    return plan


def interleaved_plan(
    stages: int, stage: int, virtual_stages: int, num_microbatches: int, forward_only: bool = False
) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al., 2021): each stage holds ``virtual_stages`` model chunks and
    runs micro-batches in groups of ``stages`` through one chunk after the other, which divides the bubble
    by ``virtual_stages``. Needs the number of micro-batches to be a multiple of ``stages``.

    Forward number k (0-based, over all chunks) of a stage runs chunk ``(k mod p·v) // p`` on micro-batch
    ``(k // p·v)·p + k mod p``; backwards run the chunks in reverse. Stage s warms up with
    ``2(p - s - 1) + (v - 1)p`` forwards (all of them when the micro-batches are exactly p), then each step
    runs one forward and one backward and exchanges both results with the neighbours in one Exchange.
    """
    p, v, m = stages, virtual_stages, num_microbatches
    error = interleaved_schedule_error(p, v, m)
    if error:
        raise ValueError(error)
    first, last = stage == 0, stage == p - 1
    total = m * v

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def micro_batch_of(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def next_input_chunk(k: int) -> Optional[int]:
        """Chunk whose input arrives while forward k is the latest one run."""
        if k + 1 >= total:
            return None
        c = chunk_of(k + 1, True)
        return None if first and c == 0 else c

    if forward_only or m == p:
        warmup = total
    else:
        warmup = min(2 * (p - stage - 1) + (v - 1) * p, total)
    steady = total - warmup
    plan: list[Action] = []
    plan += _exchange(recv_forward=None if first else 0)
    for k in range(warmup):
        c = chunk_of(k, True)
        plan.append(Forward(c, micro_batch_of(k)))
        # The first backward's gradient is asked for with the last warm-up forward, as the next stage's
        # first backward produces it while this stage starts the steady state.
        first_gradient = k == warmup - 1 and steady > 0 and not last
        plan += _exchange(
            send_forward=not (last and c == v - 1),
            recv_forward=next_input_chunk(k),
            recv_backward=v - 1 if first_gradient else None,
        )
    for j in range(steady):
        k = warmup + j
        fc, bc = chunk_of(k, True), chunk_of(j, False)
        plan.append(Forward(fc, micro_batch_of(k)))
        plan.append(Backward(bc, micro_batch_of(j)))
        recv_forward: Optional[int]
        if first:  # what the last stage sends now is for the chunk after the one it ran p - 1 forwards ago
            c = chunk_of(k - (p - 1), True)
            recv_forward = c + 1 if c < v - 1 else None
        else:
            recv_forward = chunk_of(k + 1, True)
        if j == steady - 1:
            recv_forward = None
        recv_backward: Optional[int]
        if last:  # likewise for gradients coming back from the first stage
            c = chunk_of(j - (p - 1), False)
            recv_backward = c - 1 if c > 0 else None
        else:
            recv_backward = chunk_of(j + 1, False)
        plan += _exchange(
            send_forward=not (last and fc == v - 1),
            send_backward=not (first and bc == 0),
            recv_forward=recv_forward,
            recv_backward=recv_backward,
        )
    if forward_only:
        return plan
    if steady == 0 and not last:  # all forwards done in warm-up: the first gradient has not been asked for
        plan += _exchange(recv_backward=v - 1)
    for k in range(steady, total):
        bc = chunk_of(k, False)
        plan.append(Backward(bc, micro_batch_of(k)))
        recv_backward = None
        if k + 1 < total:
            nc = chunk_of(k + 1, False)
            recv_backward = None if last and nc == v - 1 else nc
        plan += _exchange(send_backward=not (first and bc == 0), recv_backward=recv_backward)
    return plan


def build_plan(
    stages: int,
    stage: int,
    num_microbatches: int,
    virtual_stages: Optional[int] = None,
    forward_only: bool = False,
    schedule: Optional[str] = None,
) -> list[Action]:
    """The plan the recipe's schedule runs on ``stage``: no pipelining, 1F1B, interleaved 1F1B, or a
    zero-bubble schedule (``schedule``, see :mod:`megacann.pipeline.zero_bubble`). ``schedule`` None picks
    1F1B or interleaved 1F1B from ``virtual_stages``, as before the key existed."""
    if num_microbatches < 1:
        raise ValueError(f"a schedule needs at least one micro-batch, got {num_microbatches}")
    if stages == 1:
        return no_pipelining_plan(num_microbatches, forward_only)
    if schedule in ("zbv", "dualpipev"):
        from megacann.pipeline.v_schedules import v_plan  # builds on this module's actions

        return v_plan(schedule, stages, stage, num_microbatches, forward_only)
    if schedule not in (None, "1f1b", "interleaved"):
        from megacann.pipeline.zero_bubble import zero_bubble_plan  # builds on this module's actions

        return zero_bubble_plan(schedule, stages, stage, num_microbatches, forward_only)
    if virtual_stages and virtual_stages > 1:
        return interleaved_plan(stages, stage, virtual_stages, num_microbatches, forward_only)
    return one_f_one_b_plan(stages, stage, num_microbatches, forward_only)
