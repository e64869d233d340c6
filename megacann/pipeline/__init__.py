"""Pipeline parallelism: stage partitioning, point-to-point transfers, plans and the schedules that run them."""

from megacann.pipeline.p2p import activation_shape
from megacann.pipeline.partition import stage_layer_ids
from megacann.pipeline.plan import build_plan
from megacann.pipeline.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining,
    forward_step,
    get_forward_backward_func,
    run_plan,
)
from megacann.pipeline.simulate import PlanError, simulate_schedule
from megacann.pipeline.timeline import Timeline

__all__ = [
    "PlanError",
    "Timeline",
    "activation_shape",
    "build_plan",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining",
    "forward_step",
    "get_forward_backward_func",
    "run_plan",
    "simulate_schedule",
    "stage_layer_ids",
]
