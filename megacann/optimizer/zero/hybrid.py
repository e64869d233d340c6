"""Hybrid sharding (``distributed.zero_shard_group_size: k``): ZeRO shards within groups of k consecutive
data-parallel ranks (a node) and replicates across the groups, so weights are gathered over the fast links
only. Gradients are reduce-scattered within a shard group, then each owned range is all-reduced over its
*replica group* (the ranks holding the same range in the other shard groups)."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from megacann import parallel_state as ps

# dense parameters: the data-parallel x context-parallel groups; experts: expert-data-parallel x context
_KINDS = {False: "dp_cp", True: "expert_dp_cp"}


class HybridGroups:
    """This rank's shard and replica groups for dense and expert parameters, created on every rank in the
    same order (every rank calls the constructor)."""

    def __init__(self, shard_size: int):
        layout = ps.get_rank_layout()
        if layout is None:
            raise ValueError("distributed.zero_shard_group_size needs the model-parallel groups initialized")
        rank = dist.get_rank()
        self.shard_size = shard_size
        self.shard: dict[bool, tuple[Optional[dist.ProcessGroup], int]] = {}
        self.replica: dict[bool, Optional[dist.ProcessGroup]] = {}
        for expert, kind in _KINDS.items():
            for ranks in layout.groups[kind]:
                if len(ranks) % shard_size:
                    raise ValueError(
                        f"distributed.zero_shard_group_size {shard_size} does not divide the {kind} group size "
                        f"{len(ranks)}"
                    )
                shards = [ranks[i : i + shard_size] for i in range(0, len(ranks), shard_size)]
                replicas = [ranks[i::shard_size] for i in range(shard_size)]
                for members in shards:
                    group = dist.new_group(members) if len(members) > 1 else None
                    if rank in members:
                        self.shard[expert] = (group, len(members))
                for members in replicas:
                    group = dist.new_group(members) if len(members) > 1 else None
                    if rank in members:
                        self.replica[expert] = group

    def group_for(self, expert: bool) -> tuple[Optional[dist.ProcessGroup], int]:
        """The group a buffer shards over, and its size."""
        return self.shard[expert]
