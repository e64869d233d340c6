"""Pipeline parallelism: stage partitioning and the forward/backward schedules."""

from megacann.pipeline.partition import stage_layer_ids
from megacann.pipeline.schedules import forward_backward_no_pipelining, get_forward_backward_func

__all__ = ["forward_backward_no_pipelining", "get_forward_backward_func", "stage_layer_ids"]
