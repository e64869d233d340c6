"""The ``tp-cp-ep-dp-pp`` rank grid as a pure function: which global ranks share each kind of group.

Tensor-parallel ranks are adjacent (fastest varying) and pipeline stages vary slowest; expert parallelism
is carved out of data parallelism (the dense data-parallel group spans ep and dp, the expert-data-parallel
group dp only). Nothing here creates a process group, so the dry run and the planner lay out a 1,024-rank
world on one CPU; :mod:`megacann.parallel_state` creates the groups from it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

ORDER = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class RankLayout:
    """Every group of the ``tp-cp-ep-dp-pp`` grid as lists of global ranks."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    expert_model_parallel_size: int
    data_parallel_size: int  # dense data parallelism (includes the expert-parallel dimension)
    groups: dict[str, list[list[int]]]

    def group_of(self, kind: str, rank: int) -> list[int]:
        for group in self.groups[kind]:
            if rank in group:
                return group
        raise KeyError(f"rank {rank} is in no {kind} group")


def _sizes_error(world_size: int, tp: int, pp: int, cp: int, ep: int) -> Optional[str]:
    for name, value in (("tensor", tp), ("pipeline", pp), ("context", cp), ("expert", ep)):
        if value < 1:
            return f"{name}_model_parallel_size must be >= 1, got {value}"
    model = tp * pp * cp
    if world_size % model:
        return (
            f"world_size {world_size} is not divisible by tensor_model_parallel_size {tp} x "
            f"pipeline_model_parallel_size {pp} x context_parallel_size {cp} = {model}"
        )
    dp = world_size // model
    if dp % ep:
        return (
            f"expert_model_parallel_size {ep} does not divide the data-parallel size {dp} "
            f"(world_size {world_size} / (tp {tp} x pp {pp} x cp {cp}))"
        )
    return None


def rank_layout(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
) -> RankLayout:
    """Compute all process groups for a world, without creating any. Raises ValueError on bad sizes."""
    tp, pp, cp, ep = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
    )
    err = _sizes_error(world_size, tp, pp, cp, ep)
    if err:
        raise ValueError(err)
    dp = world_size // (tp * pp * cp)
    sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp // ep, "pp": pp}

    def rank_at(coord: dict[str, int]) -> int:
        rank, stride = 0, 1
        for dim in ORDER:
            rank += coord[dim] * stride
            stride *= sizes[dim]
        return rank

    def groups_over(dims: tuple[str, ...]) -> list[list[int]]:
        """Groups of ranks that differ only in ``dims``, ordered by their lowest rank."""
        fixed = [d for d in ORDER if d not in dims]
        result = []
        for fixed_coord in itertools.product(*(range(sizes[d]) for d in fixed)):
            base = dict(zip(fixed, fixed_coord))
            members = [
                rank_at({**base, **dict(zip(dims, varying))})
                for varying in itertools.product(*(range(sizes[d]) for d in dims))
            ]
            result.append(sorted(members))
        return sorted(result)

    pipeline = groups_over(("pp",))
    groups = {
        "tp": groups_over(("tp",)),
        "cp": groups_over(("cp",)),
        "ep": groups_over(("ep",)),
        "dp": groups_over(("ep", "dp")),
        "dp_cp": groups_over(("cp", "ep", "dp")),
        "expert_dp": groups_over(("dp",)),
        "expert_dp_cp": groups_over(("cp", "dp")),
        "pp": pipeline,
        "mp": groups_over(("tp", "pp")),
        "embedding": [sorted({g[0], g[-1]}) for g in pipeline],
    }
    return RankLayout(world_size, tp, pp, cp, ep, dp, groups)
