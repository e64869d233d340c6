"""Start one rank: device, collectives, model-parallel groups, seeds and the failure monitor, as the recipe says."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megacann import ops
from megacann import parallel_state as ps
from megacann.accelerator import Accelerator, get_accelerator
from megacann.config import MegacannConfig, validate
from megacann.host_memory import keep_freed_host_memory
from megacann.pipeline.overlap import overlap_wanted
from megacann.training.failure import start_failure_monitor, stop_failure_monitor


@dataclass
class Runtime:
    accelerator: Accelerator
    device: torch.device
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def seed_everything(seed: int) -> None:
    """Python, NumPy, torch CPU and device generators, and the tensor-parallel RNG tracker."""
    from megacann.layers import model_parallel_manual_seed

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_manual_seed(seed)


def setup_runtime(cfg: MegacannConfig) -> Runtime:
    """Initialise collectives (torchrun env or one process), the process groups and the seeds."""
    accelerator = get_accelerator(cfg.distributed.device)
    if accelerator.device_type == "cpu":
        keep_freed_host_memory()  # each step's buffers reuse the last step's pages (megacann.host_memory)
    rank, world, local_rank = ps.initialize_distributed(accelerator.backend, cfg.distributed.timeout_minutes)
    accelerator.set_device(local_rank)
    validate(cfg, world_size=world)
    d = cfg.distributed
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=d.tensor_parallel_size,
            pipeline_model_parallel_size=d.pipeline_parallel_size,
            virtual_pipeline_model_parallel_size=d.virtual_pipeline_size,
            context_parallel_size=d.context_parallel_size,
            expert_model_parallel_size=d.expert_parallel_size,
            timeout_minutes=d.timeout_minutes,
            communication_lanes=2 if overlap_wanted(cfg) else 1,  # dualpipev's pairs at once, a lane per chunk
        )
    seed_everything(cfg.seed)
    ops.configure(cfg.precision.fused_ops, cfg.precision.fp32_ops)
    start_failure_monitor(rank, world, d.timeout_minutes)
    return Runtime(accelerator, accelerator.current_device(), rank, world, local_rank)


def shutdown_runtime() -> None:
    """End a rank cleanly: stop and join the failure monitor, forget and destroy every process group.
    Safe to call more than once, and when nothing was started."""
    stop_failure_monitor()
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
