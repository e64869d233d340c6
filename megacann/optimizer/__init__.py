"""Optimizers: fp32 master weights, loss scaling, clipping, LR schedules, ZeRO-1/2 as a drop-in, and host
offload of masters and state (``optim.offload_optimizer``)."""

from __future__ import annotations

from typing import Optional

import torch

from megacann.config import MegacannConfig
from megacann.optimizer.clip_grads import global_grad_norm
from megacann.optimizer.grad_buffer import GradBuffers
from megacann.optimizer.lr_schedule import LRSchedule
from megacann.optimizer.optimizer import MixedPrecisionOptimizer, OptimizerBase, StateShard
from megacann.optimizer.registry_adamw import RegistryAdamW
from megacann.optimizer.zero import DistributedOptimizer


def build_optimizer(
    cfg: MegacannConfig,
    named_params: list[tuple[str, torch.nn.Parameter]],
    modules: Optional[list[torch.nn.Module]] = None,
    sharding_units: tuple[type[torch.nn.Module], ...] = (),
) -> OptimizerBase:
    """The optimizer for this rank's parameters (global names), as the recipe asks (plain DP or ZeRO).
    ``modules`` (the model chunks) let ZeRO wait for overlapped parameter gathers in forward hooks, and
    ZeRO-3 gather each chunk's modules of the classes ``sharding_units`` (the family's
    ``ModelSpec.sharding_units``) one at a time (none: a whole chunk at a time)."""
    d = cfg.distributed
    offload = cfg.optim.offload_optimizer  # fp32 masters and state in host memory (megacann.optimizer.offload)
    if offload:
        from megacann.optimizer.offload import OffloadedDistributedOptimizer, OffloadedOptimizer
    if d.zero_stage:
        return (OffloadedDistributedOptimizer if offload else DistributedOptimizer)(
            named_params, cfg, modules, sharding_units
        )
    if d.overlap_param_gather:
        raise ValueError(
            "distributed.overlap_param_gather needs distributed.zero_optimization (true, 1, 2 or 3): without ZeRO "
            "no parameters are gathered"
        )
    return (OffloadedOptimizer if offload else MixedPrecisionOptimizer)(named_params, cfg)


__all__ = [
    "DistributedOptimizer",
    "GradBuffers",
    "LRSchedule",
    "MixedPrecisionOptimizer",
    "OptimizerBase",
    "RegistryAdamW",
    "StateShard",
    "build_optimizer",
    "global_grad_norm",
]
