"""1F1B and its split-backward variant zb1p: one model chunk per stage, on the loop placement.

1F1B (PipeDream-Flush): stage s runs ``stages - s - 1`` warm-up forwards, then alternates one forward and
one backward, then drains the remaining backwards. Any number of micro-batches works (with fewer than
stages the warm-up is shorter and the bubble larger).

zb1p, ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): the same order with each backward split
into B (input gradient) and W (weight gradient), W run right after B's gradient is sent. The previous
stage waits only for B, so the gradient travels back through the stages at the pace of B alone, while
the activation memory stays 1F1B's. With forward, B and W taking one unit each, a 1F1B step takes
3m + 3(p - 1) units, this plan 3m + 2(p - 1) (the simulator's figure): the bubble shrinks by a third.
The paper's (p - 1)(F + B - W) = p - 1 needs sends that do not wait for their receiver; the executor's
exchanges wait for all of their transfers (what NCCL and HCCL need of unbatched pairs), which leaves one
unit per stage of the wait. Deferring W further (the paper's delays) gains nothing under that rule and
raises the memory, as the whole graph of a micro-batch stays alive until its W
(:mod:`megacann.pipeline.split_backward`).
"""

from __future__ import annotations

from typing import Optional

from megacann.pipeline.actions import Action, Backward, BackwardInput, BackwardWeight, Forward, exchange
from megacann.pipeline.placement import LOOP
from megacann.pipeline.schedule_spec import LayoutCheck, ScheduleSpec


def one_f_one_b_plan(
    stages: int, stage: int, num_microbatches: int, forward_only: bool = False, split_backward: bool = False
) -> list[Action]:
    """1F1B on ``stage`` (see the module docstring); ``split_backward``: each backward as B, and its W
    right after B's gradient is sent (zb1p)."""
    first, last = stage == 0, stage == stages - 1
    m = num_microbatches
    recv_input = None if first else 0
    plan: list[Action] = []
    if forward_only:
        for i in range(m):
            plan += exchange(recv_forward=recv_input)
            plan.append(Forward(0, i))
            plan += exchange(send_forward=not last)
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
        plan += exchange(recv_forward=recv_input)
        plan.append(Forward(0, i))
        plan += exchange(send_forward=not last)
    if steady:
        plan += exchange(recv_forward=recv_input)
    for j in range(steady):
        plan.append(Forward(0, warmup + j))
        plan += exchange(send_forward=not last, recv_backward=None if last else 0)
        more_forwards = j < steady - 1
        backward(j, exchange(send_backward=not first, recv_forward=recv_input if more_forwards else None))
    for j in range(steady, m):
        plan += exchange(recv_backward=None if last else 0)
        backward(j, exchange(send_backward=not first))
    return plan


def zb1p_plan(stages: int, stage: int, num_microbatches: int, forward_only: bool = False) -> list[Action]:
    """ZB-H1 on one stage: forwards and B in 1F1B order, so at most p - s micro-batches are alive on stage s
    as in 1F1B; each W right after its B's gradient is sent, so it never delays the previous stage, and in
    the cool-down it fills the wait for the next gradient."""
    return one_f_one_b_plan(stages, stage, num_microbatches, forward_only, split_backward=True)


def one_chunk_error(name: str) -> LayoutCheck:
    """The layout check of a schedule that runs one model chunk per stage."""

    def error(stages: int, virtual_size: Optional[int]) -> Optional[str]:
        vpp = virtual_size or 1
        if vpp > 1:
            return (
                f"distributed.pipeline_schedule {name!r} runs one model chunk per stage, but "
                f"distributed.virtual_pipeline_size is {vpp}: unset it, or use 'interleaved'"
            )
        return None

    return error


ONE_F_ONE_B = ScheduleSpec(
    name="1f1b",
    placement=LOOP,
    build=lambda stages, stage, m, virtual, forward_only: one_f_one_b_plan(stages, stage, m, forward_only),
    label="1F1B",
    layout_error=one_chunk_error("1f1b"),
)
ZB1P = ScheduleSpec(
    name="zb1p",
    placement=LOOP,
    build=lambda stages, stage, m, virtual, forward_only: zb1p_plan(stages, stage, m, forward_only),
    label="zb1p (ZB-H1 zero bubble: backward split into input and weight gradients)",
    split_backward=True,
    layout_error=one_chunk_error("zb1p"),
)
