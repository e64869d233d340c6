"""Interleaved 1F1B (Narayanan et al., 2021): several model chunks per stage on the loop placement.

Each stage holds ``virtual_stages`` model chunks and runs micro-batches in groups of ``stages`` through one
chunk after the other, which divides the bubble by ``virtual_stages``. The number of micro-batches must be
a multiple of ``stages``.
"""

from __future__ import annotations

from typing import Optional

from megacann.pipeline.actions import Action, Backward, Forward, exchange
from megacann.pipeline.placement import LOOP
from megacann.pipeline.schedule_spec import ScheduleSpec


def interleaved_schedule_error(pipeline_size: int, virtual_size: int, num_microbatches: int) -> Optional[str]:
    """Why the interleaved 1F1B schedule cannot run this many micro-batches, or None when it can."""
    p, m = pipeline_size, num_microbatches
    if m % p == 0:
        return None
    lower, upper = m - m % p, m + p - m % p
    options = f"{lower} or {upper}" if lower else f"{upper}"
    return (
        f"the interleaved 1F1B schedule (virtual_pipeline_size {virtual_size}) needs the number of "
        f"micro-batches, optim.grad_accum_steps, to be a multiple of pipeline_parallel_size {p}, got {m}: "
        f"use {options}, or no virtual stages (1F1B takes any number)"
    )


def interleaved_plan(
    stages: int, stage: int, virtual_stages: int, num_microbatches: int, forward_only: bool = False
) -> list[Action]:
    """Interleaved 1F1B on ``stage``.

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
    plan += exchange(recv_forward=None if first else 0)
    for k in range(warmup):
        c = chunk_of(k, True)
        plan.append(Forward(c, micro_batch_of(k)))
        # The first backward's gradient is asked for with the last warm-up forward, as the next stage's
        # first backward produces it while this stage starts the steady state.
        first_gradient = k == warmup - 1 and steady > 0 and not last
        plan += exchange(
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
        plan += exchange(
            send_forward=not (last and fc == v - 1),
            send_backward=not (first and bc == 0),
            recv_forward=recv_forward,
            recv_backward=recv_backward,
        )
    if forward_only:
        return plan
    if steady == 0 and not last:  # all forwards done in warm-up: the first gradient has not been asked for
        plan += exchange(recv_backward=v - 1)
    for k in range(steady, total):
        bc = chunk_of(k, False)
        plan.append(Backward(bc, micro_batch_of(k)))
        recv_backward = None
        if k + 1 < total:
            nc = chunk_of(k + 1, False)
            recv_backward = None if last and nc == v - 1 else nc
        plan += exchange(send_backward=not (first and bc == 0), recv_backward=recv_backward)
    return plan


def _layout_error(stages: int, virtual_size: Optional[int]) -> Optional[str]:
    if (virtual_size or 1) < 2:
        return (
            f"distributed.pipeline_schedule 'interleaved' needs distributed.virtual_pipeline_size >= 2, "
            f"got {virtual_size}"
        )
    return None


INTERLEAVED = ScheduleSpec(
    name="interleaved",
    placement=LOOP,
    build=lambda stages, stage, m, virtual, forward_only: interleaved_plan(stages, stage, virtual, m, forward_only),
    label="interleaved 1F1B, {chunks} chunks per stage",
    layout_error=_layout_error,
    micro_batch_error=lambda stages, virtual, m: interleaved_schedule_error(stages, virtual or 1, m),
    min_virtual_size=2,
)
