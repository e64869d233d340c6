"""Optimizers: fp32 master weights, loss scaling, clipping, LR schedules; ZeRO arrives as a drop-in."""

from __future__ import annotations

import torch

from megacann.config import MegacannConfig
from megacann.optimizer.clip_grads import global_grad_norm
from megacann.optimizer.grad_buffer import GradBuffers
from megacann.optimizer.lr_schedule import LRSchedule
from megacann.optimizer.optimizer import MixedPrecisionOptimizer, StateShard


def build_optimizer(cfg: MegacannConfig, named_params: list[tuple[str, torch.nn.Parameter]]) -> MixedPrecisionOptimizer:
    """The optimizer for this rank's parameters (global names), as the recipe asks (plain DP or ZeRO)."""
    if cfg.distributed.zero_stage:
        raise NotImplementedError(
            "distributed.zero_optimization is not implemented yet (set it to false); see the ZeRO issue"
        )
    return MixedPrecisionOptimizer(named_params, cfg)


__all__ = ["GradBuffers", "LRSchedule", "MixedPrecisionOptimizer", "StateShard", "build_optimizer", "global_grad_norm"]
