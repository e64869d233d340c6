"""Zero-bubble schedules: the backward split into B (input gradient) and W (weight gradient), W run later.

The previous stage waits only for B, the gradient of a chunk's input; the weight gradients W wait for
nobody. ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) keeps the order and the activation
memory of 1F1B and moves W out of the gradient's way, so the gradient travels back through the stages at
the pace of B alone. With forward, B and W taking one unit each, a 1F1B step takes 3m + 3(p - 1) units,
this plan 3m + 2(p - 1) (the simulator's figure): the bubble shrinks by a third. The paper's
(p - 1)(F + B - W) = p - 1 needs sends that do not wait for their receiver; the executor's exchanges wait
for all of their transfers (what NCCL and HCCL need of unbatched pairs), which leaves one unit per stage of
the wait. Deferring W further (the paper's delays) gains nothing under that rule and raises the memory,
as the whole graph of a micro-batch stays alive until its W (:mod:`megacann.pipeline.split_backward`).

Names accepted by ``distributed.pipeline_schedule`` live in :data:`megacann.pipeline.rules.SCHEDULES`;
the V-shaped ones (``zbv``, ``dualpipev``) place two chunks per stage in a V: :mod:`megacann.pipeline.v_schedules`.
"""

from __future__ import annotations

from megacann.pipeline.plan import Action, one_f_one_b_plan
from megacann.pipeline.rules import schedule_error


def zb1p_plan(stages: int, stage: int, num_microbatches: int, forward_only: bool = False) -> list[Action]:
    """ZB-H1 on one stage: the forwards and input gradients (B) in 1F1B order, so at most p - s
    micro-batches are alive on stage s as in 1F1B; each W runs right after its B's gradient is sent, so it
    never delays the previous stage, and in the cool-down it fills the wait for the next gradient."""
    return one_f_one_b_plan(stages, stage, num_microbatches, forward_only, split_backward=True)


def zero_bubble_plan(
    schedule: str, stages: int, stage: int, num_microbatches: int, forward_only: bool = False
) -> list[Action]:
    """The plan of ``schedule`` (one of :data:`SCHEDULES` past 1F1B and interleaved) on ``stage``."""
    error = schedule_error(schedule, stages, None)
    if error:
        raise ValueError(error)
    return zb1p_plan(stages, stage, num_microbatches, forward_only)
