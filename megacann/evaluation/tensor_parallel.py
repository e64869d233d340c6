"""The lm-eval adapter at tensor parallel size ``tp``: the process groups it needs, made before the model is
loaded, so the loader reads only this rank's shards.

Every rank of the TP group runs every request (the model needs all of them for each forward); lm-eval
splits requests across ranks only by the model's ``rank`` / ``world_size``, which stay 0 and 1, and returns
results only where ``LOCAL_RANK`` is 0 (its convention for tensor-parallel launchers such as torchrun).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps


def tensor_parallel_size(requested: Optional[int]) -> int:
    """``requested``, else the launcher's ``WORLD_SIZE`` (torchrun sets it), else 1."""
    size = int(requested) if requested is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if size < 1:
        raise ValueError(f"megacann lm-eval model: tensor_parallel_size must be >= 1, got {size}")
    return size


def start_tensor_parallel(size: int, device: Optional[str]) -> Optional[str]:
    """Make the TP groups of ``size`` ranks (the process group from the launcher's environment when none
    is up); return the device this rank loads on (``cuda`` becomes this rank's GPU)."""
    if not dist.is_initialized() and "RANK" in os.environ:  # launched by torchrun: its process group
        on_gpu = device is not None and device.startswith("cuda") and torch.cuda.is_available()
        dist.init_process_group("nccl" if on_gpu else "gloo")
    processes = dist.get_world_size() if dist.is_initialized() else 1
    if processes < size:
        raise ValueError(
            f"megacann lm-eval model: tensor_parallel_size {size} needs {size} processes, e.g. "
            f"torchrun --nproc_per_node {size} -m megacann.evaluation ... (this run has {processes})"
        )
    if processes > size:
        raise ValueError(
            f"megacann lm-eval model: tensor_parallel_size {size} must equal the number of processes "
            f"({processes}): data parallel evaluation is not supported"
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=size)
    elif ps.get_tensor_model_parallel_world_size() != size:
        raise ValueError(
            f"megacann lm-eval model: tensor_parallel_size {size}, but this process's layout has "
            f"tensor parallel size {ps.get_tensor_model_parallel_world_size()}"
        )
    if device is not None and device.startswith("cuda") and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', dist.get_rank()))}"
        torch.cuda.set_device(device)
    return device
