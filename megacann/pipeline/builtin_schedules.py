"""The built-in schedules, registered in the order the recipe check lists them."""

from __future__ import annotations

from megacann.pipeline.interleaved import INTERLEAVED
from megacann.pipeline.one_f_one_b import ONE_F_ONE_B, ZB1P
from megacann.pipeline.schedule_spec import register_schedule
from megacann.pipeline.v_schedules import DUALPIPEV, ZBV

for _spec in (ONE_F_ONE_B, INTERLEAVED, ZB1P, ZBV, DUALPIPEV):
    register_schedule(_spec)
