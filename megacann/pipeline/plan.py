"""Schedules as plans: the exact sequence of forwards, backwards and transfers one pipeline stage runs.

A plan is a list of the actions of :mod:`megacann.pipeline.actions`. Plans are pure functions of
(stages, stage, micro-batches, virtual stages, schedule), so every rank can build any rank's plan, and
:mod:`megacann.pipeline.simulate` can check that all plans of a pipeline pair up without deadlock,
deliver every tensor where it belongs, and estimate the bubble. Each schedule builds its plans itself
(:class:`~megacann.pipeline.schedule_spec.ScheduleSpec`: :mod:`~megacann.pipeline.one_f_one_b`,
:mod:`~megacann.pipeline.interleaved`, :mod:`~megacann.pipeline.v_schedules`); where its chunks sit is
its :mod:`~megacann.pipeline.placement`.
"""

from __future__ import annotations

from typing import Optional

import megacann.pipeline.builtin_schedules  # noqa: F401  (registers the built-in schedules)
from megacann.pipeline.actions import (  # noqa: F401  (the actions, importable from here as ever)
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Compute,
    Exchange,
    Forward,
    Transfer,
    VExchange,
)
from megacann.pipeline.interleaved import interleaved_plan  # noqa: F401
from megacann.pipeline.one_f_one_b import one_f_one_b_plan  # noqa: F401
from megacann.pipeline.schedule_spec import schedule_for


def no_pipelining_plan(num_microbatches: int, forward_only: bool = False) -> list[Action]:
    """Gradient accumulation on one stage: forward and backward of each micro-batch in turn."""
    plan: list[Action] = []
    for i in range(num_microbatches):
        plan.append(Forward(0, i))
        if not forward_only:
            plan.append(Backward(0, i))
    return plan


def build_plan(
    stages: int,
    stage: int,
    num_microbatches: int,
    virtual_stages: Optional[int] = None,
    forward_only: bool = False,
    schedule: Optional[str] = None,
) -> list[Action]:
    """The plan ``schedule`` (``distributed.pipeline_schedule``, a registered name) runs on ``stage``; one
    stage runs plain gradient accumulation whatever the schedule. ``schedule`` None picks 1F1B or
    interleaved 1F1B from ``virtual_stages``. ValueError for a layout the schedule refuses."""
    if num_microbatches < 1:
        raise ValueError(f"a schedule needs at least one micro-batch, got {num_microbatches}")
    if stages == 1:
        return no_pipelining_plan(num_microbatches, forward_only)
    spec = schedule_for(schedule, virtual_stages)
    error = spec.layout_error(stages, virtual_stages)
    if error:
        raise ValueError(error)
    return spec.build(stages, stage, num_microbatches, virtual_stages, forward_only)
