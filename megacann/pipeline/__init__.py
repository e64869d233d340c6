"""Pipeline parallelism: schedules as registered specs (plans as data, one placement object each), stage
partitioning and this rank's model chunks, the layout rules, point-to-point transfers, the simulator and
the one runner that executes a plan."""

from megacann.pipeline.executor import PlanRunner, run_plan
from megacann.pipeline.p2p import activation_shape
from megacann.pipeline.partition import build_model_chunks, chunk_placements, stage_layer_ids
from megacann.pipeline.placement import LOOP, Placement, V
from megacann.pipeline.plan import build_plan
from megacann.pipeline.rules import (
    check_pipeline_config,
    interleaved_schedule_error,
    loss_stage,
    pipeline_bubble_fraction,
)
from megacann.pipeline.schedule_spec import (
    ScheduleSpec,
    get_schedule,
    register_schedule,
    registered_schedules,
    unregister_schedule,
)
from megacann.pipeline.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining,
    get_forward_backward_func,
)
from megacann.pipeline.simulate import PlanError, simulate_schedule
from megacann.pipeline.timeline import Timeline

__all__ = [
    "LOOP",
    "V",
    "PlanError",
    "PlanRunner",
    "Placement",
    "ScheduleSpec",
    "Timeline",
    "activation_shape",
    "build_model_chunks",
    "build_plan",
    "check_pipeline_config",
    "chunk_placements",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining",
    "get_forward_backward_func",
    "get_schedule",
    "interleaved_schedule_error",
    "loss_stage",
    "pipeline_bubble_fraction",
    "register_schedule",
    "registered_schedules",
    "run_plan",
    "simulate_schedule",
    "stage_layer_ids",
    "unregister_schedule",
]
