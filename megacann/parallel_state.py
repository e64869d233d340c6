"""Process groups for tensor, context, expert, data and pipeline parallelism (Megatron-Core names).

Ranks are laid out in the order ``tp-cp-ep-dp-pp``: tensor-parallel ranks are adjacent (fastest varying)
and pipeline stages vary slowest. Expert parallelism is carved out of data parallelism: the dense
data-parallel group spans the ep and dp dimensions, the expert-data-parallel group only dp.

The rank layout itself is a pure function (:func:`rank_layout`, in :mod:`megacann.rank_layout`), so the
dry run can print a 32-rank layout on one CPU without creating any group. When model parallelism is not initialised every getter
answers as for a single process, so ``megacann.layers`` works in a plain script.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from megacann.communication_lanes import LANE_KINDS, active_lane, check_lane_count
from megacann.communication_lanes import communication_lane as communication_lane  # ps.communication_lane(c)
from megacann.rank_layout import ORDER as ORDER
from megacann.rank_layout import RankLayout as RankLayout
from megacann.rank_layout import rank_layout as rank_layout

# ---------------------------------------------------------------------------------------------------
# Global state: the groups this rank belongs to.


@dataclass
class _State:
    layout: RankLayout
    rank: int
    groups: dict[str, Optional[dist.ProcessGroup]]
    virtual_pipeline_size: Optional[int] = None
    virtual_pipeline_rank: Optional[int] = None
    lanes: list[dict[str, dist.ProcessGroup]] = field(default_factory=list)  # megacann.communication_lanes


_STATE: Optional[_State] = None


def _attempt_store(world: int, timeout: datetime.timedelta) -> Optional[dist.Store]:
    """Under torchrun, whose agent hosts the rendezvous store for the whole job, a client of that store
    whose keys are this attempt's own: after a restart (``--max-restarts``) the store still holds the
    previous attempt's keys (a dead rank's address among them), which a new rank could read first."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"megacann/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def initialize_distributed(
    backend: str = "gloo",
    timeout_minutes: float = 30.0,
    init_method: Optional[str] = None,
) -> tuple[int, int, int]:
    """Start torch.distributed from torchrun's environment, or as a one-process world without it.

    Returns (rank, world_size, local_rank). Safe to call when already initialised.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ and init_method is None]
        if missing:
            raise RuntimeError(f"RANK and WORLD_SIZE are set but {', '.join(missing)} is not")
        store = _attempt_store(world, timeout) if init_method is None else None
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=init_method or "env://", rank=rank, world_size=world, timeout=timeout
            )
    else:
        rank, world, local_rank = 0, 1, 0
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return rank, world, local_rank


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    timeout_minutes: Optional[float] = None,
    communication_lanes: int = 1,
) -> RankLayout:
    """Create every process group of the ``tp-cp-ep-dp-pp`` grid (all ranks must call this).
    ``timeout_minutes``: the groups' collective timeout (None: torch's default for the backend, which is
    not the world group's). ``communication_lanes`` > 1: also that many - 1 duplicates of the groups in
    ``LANE_KINDS`` (see :func:`communication_lane`)."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call initialize_distributed() first")
    if _STATE is not None:
        raise RuntimeError("model parallel groups are already initialised; call destroy_model_parallel()")
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = rank_layout(
        world,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
    )
    vpp = virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1 and pipeline_model_parallel_size < 2:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size {vpp} needs "
            f"pipeline_model_parallel_size > 1, got {pipeline_model_parallel_size}"
        )
    check_lane_count(communication_lanes)
    timeout = datetime.timedelta(minutes=timeout_minutes) if timeout_minutes is not None else None
    mine = _create_groups(layout.groups, rank, timeout)
    lane_groups = {kind: layout.groups[kind] for kind in LANE_KINDS}
    lanes = [_create_groups(lane_groups, rank, timeout) for _ in range(communication_lanes - 1)]
    vpp_rank = 0 if virtual_pipeline_model_parallel_size else None
    _STATE = _State(layout, rank, mine, virtual_pipeline_model_parallel_size, vpp_rank, lanes)
    return layout


def _create_groups(
    groups: dict[str, list[list[int]]], rank: int, timeout: Optional[datetime.timedelta]
) -> dict[str, dist.ProcessGroup]:
    """Create a new communicator for every distinct rank list in ``groups`` (every rank creates every
    group, in the same order); return, by kind, the ones this rank belongs to."""
    world = dist.get_world_size()
    mine: dict[str, dist.ProcessGroup] = {}
    created: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for kind, kind_groups in groups.items():
        for ranks in kind_groups:
            key = tuple(ranks)
            if key not in created:
                created[key] = dist.new_group(ranks, timeout=timeout) if world > 1 else dist.group.WORLD
            if rank in ranks:
                mine[kind] = created[key]
    return mine


def communication_lanes() -> int:
    """How many communication lanes exist (1: the groups alone; see megacann.communication_lanes)."""
    return 1 if _STATE is None else 1 + len(_STATE.lanes)


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Forget the groups (the default process group is left to the caller)."""
    global _STATE
    _STATE = None


def get_rank_layout() -> Optional[RankLayout]:
    return None if _STATE is None else _STATE.layout


def _group(kind: str) -> Optional[dist.ProcessGroup]:
    if _STATE is None:
        return None
    lane = active_lane(_STATE.lanes)
    return lane[kind] if kind in lane else _STATE.groups.get(kind)


def _ranks(kind: str) -> list[int]:
    if _STATE is None:
        return [0]
    return _STATE.layout.group_of(kind, _STATE.rank)


def _group_rank(kind: str) -> int:
    return 0 if _STATE is None else _ranks(kind).index(_STATE.rank)


def _group_size(kind: str) -> int:
    return len(_ranks(kind))


# Megatron-Core getter names -------------------------------------------------------------------------


def get_tensor_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return _group("tp")


def get_tensor_model_parallel_world_size() -> int:
    return _group_size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _group_rank("tp")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first rank in this rank's tensor-parallel group."""
    return _ranks("tp")[0]


def get_pipeline_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return _group("pp")


def get_pipeline_model_parallel_world_size() -> int:
    return _group_size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _group_rank("pp")


def get_pipeline_model_parallel_ranks() -> list[int]:
    """Global ranks of this rank's pipeline, stage 0 first."""
    return _ranks("pp")


def get_data_parallel_group(with_context_parallel: bool = False) -> Optional[dist.ProcessGroup]:
    return _group("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _group_size("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _group_rank("dp_cp" if with_context_parallel else "dp")


def get_context_parallel_group() -> Optional[dist.ProcessGroup]:
    return _group("cp")


def get_context_parallel_world_size() -> int:
    return _group_size("cp")


def get_context_parallel_rank() -> int:
    return _group_rank("cp")


def get_expert_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return _group("ep")


def get_expert_model_parallel_world_size() -> int:
    return _group_size("ep")


def get_expert_model_parallel_rank() -> int:
    return _group_rank("ep")


def get_expert_data_parallel_group(with_context_parallel: bool = False) -> Optional[dist.ProcessGroup]:
    """Ranks holding the same experts; ``with_context_parallel``: and their cp peers (expert gradients)."""
    return _group("expert_dp_cp" if with_context_parallel else "expert_dp")


def get_expert_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _group_size("expert_dp_cp" if with_context_parallel else "expert_dp")


def get_expert_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _group_rank("expert_dp_cp" if with_context_parallel else "expert_dp")


def get_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """Tensor x pipeline group: the ranks that together hold one replica of the model."""
    return _group("mp")


def get_embedding_group() -> Optional[dist.ProcessGroup]:
    """First and last pipeline stage of this rank's pipeline (tied input/output embeddings)."""
    return _group("embedding")


def get_embedding_group_ranks() -> list[int]:
    return _ranks("embedding")


def is_rank_in_embedding_group() -> bool:
    """True on the first and last pipeline stage (middle stages belong to no embedding group)."""
    return _STATE is None or any(_STATE.rank in group for group in _STATE.layout.groups["embedding"])


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return None if _STATE is None else _STATE.virtual_pipeline_size


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return None if _STATE is None else _STATE.virtual_pipeline_rank


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    if _STATE is not None:
        _STATE.virtual_pipeline_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size():
        return get_virtual_pipeline_model_parallel_rank() == 0 and get_pipeline_model_parallel_rank() == 0
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vpp and get_virtual_pipeline_model_parallel_rank() != vpp - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1
