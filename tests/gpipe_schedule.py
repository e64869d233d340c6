"""GPipe (Huang et al., 2019) as a schedule of one's own: every forward of the step, then every backward.

One file and one registration: a recipe naming this module in ``experiment.imports`` may set
``distributed.pipeline_schedule: gpipe``. It runs one model chunk per stage on the loop placement and
holds every micro-batch's activations until the backwards start (1F1B holds at most p - s of them on
stage s), with the same bubble, (p - 1)/(m + p - 1). docs/pipeline.md shows it as the example.
"""

from __future__ import annotations

from typing import Optional

from megacann.pipeline import LOOP, ScheduleSpec, register_schedule
from megacann.pipeline.actions import Action, Backward, Forward, exchange


def gpipe_plan(
    stages: int, stage: int, num_microbatches: int, virtual_size: Optional[int], forward_only: bool
) -> list[Action]:
    first, last = stage == 0, stage == stages - 1
    plan: list[Action] = []
    for i in range(num_microbatches):  # receive the input, run the chunk, send the output on
        plan += exchange(recv_forward=None if first else 0)
        plan.append(Forward(0, i))
        plan += exchange(send_forward=not last)
    if forward_only:
        return plan
    for i in range(num_microbatches):  # oldest first: receive the output's gradient, back-propagate, send
        plan += exchange(recv_backward=None if last else 0)
        plan.append(Backward(0, i))
        plan += exchange(send_backward=not first)
    return plan


def one_chunk(stages: int, virtual_size: Optional[int]) -> Optional[str]:
    if (virtual_size or 1) > 1:
        return f"distributed.pipeline_schedule 'gpipe' runs one model chunk per stage, got virtual_size {virtual_size}"
    return None


GPIPE = ScheduleSpec(name="gpipe", placement=LOOP, build=gpipe_plan, label="GPipe", layout_error=one_chunk)
register_schedule(GPIPE)
