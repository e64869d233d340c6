"""Keeping the ranks of an expert-parallel group in step while they generate.

Under expert parallelism the group spans data-parallel ranks, so its ranks generate for different prompts
and finish at different steps; but every MoE layer's forward exchanges tokens with an all-to-all that each
rank of the group must join. So before each decode step the ranks agree (one all-reduce of "a row is
still live here" over the expert-parallel group) whether anyone still generates, and a rank runs an idle
step for each of its micro-batches without a live row: one pad token at position 0, without a cache, its
output thrown away, so its all-to-alls pair with the others' (every rank runs the same number of
micro-batches a round). Its tensor-parallel and pipeline peers hold the same rows (they share
every chosen token), so they reach the same answer and idle together. Without expert parallelism the
ranks that generate together share their rows, and nothing is exchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megacann import parallel_state as ps


class Lockstep:
    """Whether any rank of the expert-parallel group still generates; how a rank that has finished idles."""

    def __init__(self) -> None:
        self.group = ps.get_expert_model_parallel_group()
        self.needed = ps.get_expert_model_parallel_world_size() > 1
        self.idle_steps = 0  # forwards this rank ran only to keep the group in step (a probe for tests)

    def anyone_active(self, active_here: bool, device: torch.device) -> bool:
        """True while a rank of the group has a live row (every rank of the group calls this each step)."""
        if not self.needed:
            return active_here
        flag = torch.tensor([int(active_here)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
