"""The lm-eval adapter's process layout: ``dp x tp`` processes under a launcher (torchrun), the process
groups made before the model is loaded (so the loader reads only this rank's tensor-parallel shards), and
the collectives lm-eval's evaluator asks of a data-parallel model.

Every rank of a TP group runs every request of its data-parallel rank (the model needs all of them for each
forward). lm-eval splits the documents across ranks by the model's ``rank`` / ``world_size``, which are
the data-parallel rank and size (0 and 1 without data parallelism), gathers each rank's request counts
(:meth:`DataParallel.all_gather`; it pads the shorter ranks with copies of their last request) and, after
scoring, each rank's samples and metrics to data-parallel rank 0 (:meth:`DataParallel.gather_object`).
It returns results only where the model's rank and ``LOCAL_RANK`` are 0, so the table is printed once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps

PREFIX = "megacann lm-eval model"


def _at_least_one(name: str, value: Optional[int]) -> Optional[int]:
    if value is None:
        return None
    if int(value) < 1:
        raise ValueError(f"{PREFIX}: {name} must be >= 1, got {value}")
    return int(value)


def parallel_sizes(tensor_parallel: Optional[int], data_parallel: Optional[int]) -> tuple[int, int]:
    """(tp, dp) of the requested sizes and the launcher's ``WORLD_SIZE`` (1 outside a launcher): a size
    not given fills the processes the other leaves (neither given: every process is a TP rank)."""
    tp = _at_least_one("tensor_parallel_size", tensor_parallel)
    dp = _at_least_one("data_parallel_size", data_parallel)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp is None:
        tp = max(world // (dp or 1), 1)
    if dp is None:
        dp = max(world // tp, 1)
    return tp, dp


def start_parallel(tp: int, dp: int, device: Optional[str]) -> Optional[str]:
    """Make the TP and DP groups of ``tp x dp`` ranks (the process group from the launcher's environment
    when none is up); return the device this rank loads on (``cuda`` becomes this rank's GPU)."""
    if not dist.is_initialized() and "RANK" in os.environ:  # launched by torchrun: its process group
        on_gpu = device is not None and device.startswith("cuda") and torch.cuda.is_available()
        dist.init_process_group("nccl" if on_gpu else "gloo")
    processes = dist.get_world_size() if dist.is_initialized() else 1
    if processes != tp * dp:
        sizes = f"tensor_parallel_size {tp}" + (f" x data_parallel_size {dp}" if dp > 1 else "")
        raise ValueError(
            f"{PREFIX}: {sizes} needs {tp * dp} processes, e.g. torchrun --nproc_per_node {tp * dp} "
            f"-m megacann.evaluation ... (this run has {processes})"
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    else:
        _check_layout(tp, dp)
    if device is not None and device.startswith("cuda") and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', dist.get_rank()))}"
        torch.cuda.set_device(device)
    return device


def _check_layout(tp: int, dp: int) -> None:
    """The groups already up (a training process's) are ``tp x dp`` and nothing else."""
    for name, size in (
        ("pipeline_parallel_size", ps.get_pipeline_model_parallel_world_size()),
        ("context_parallel_size", ps.get_context_parallel_world_size()),
        ("expert_parallel_size", ps.get_expert_model_parallel_world_size()),
    ):
        if size > 1:
            raise ValueError(f"{PREFIX}: this process's layout has {name} {size}, which evaluation does not support")
    for name, wanted, size in (
        ("tensor_parallel_size", tp, ps.get_tensor_model_parallel_world_size()),
        ("data_parallel_size", dp, ps.get_data_parallel_world_size()),
    ):
        if size != wanted:
            raise ValueError(f"{PREFIX}: {name} {wanted}, but this process's layout has {size}")


@dataclass
class DataParallel:
    """lm-eval's collectives over the data-parallel group (``size`` 1: lm-eval's one-process no-ops)."""

    rank: int = 0
    size: int = 1

    @classmethod
    def current(cls) -> DataParallel:
        if not ps.model_parallel_is_initialized():
            return cls()
        return cls(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0, in rank order (a scalar counts as ``[1]``)."""
        tensor = torch.atleast_1d(tensor).contiguous()
        if self.size == 1:
            return tensor
        pieces = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(pieces, tensor, group=ps.get_data_parallel_group())
        return torch.cat(pieces)

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[list[Any]]:
        """Every rank's ``obj`` in rank order on data-parallel rank ``dst``; None on the others."""
        if self.size == 1:
            return [obj]
        group = ps.get_data_parallel_group()
        gathered: Optional[list[Any]] = [None] * self.size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dist.get_global_rank(group, dst), group=group)
        return gathered

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=ps.get_data_parallel_group())
