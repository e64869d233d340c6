"""Communication lanes: duplicates of the groups a model chunk's layers talk over, one set per thread.

Two threads that issue collectives on one process group can interleave them differently on different
ranks and hang. A DualPipeV pair runs one chunk's forward and the other's backward at once
(:mod:`megacann.pipeline.overlap`), so each chunk talks over its own lane: the same ranks in the same
order, another communicator. ``initialize_model_parallel(communication_lanes=N)`` creates lanes 1..N-1
(lane 0 is the groups themselves); :func:`communication_lane` makes this thread's getters of the
``LANE_KINDS`` groups answer with a lane's duplicates. The lanes live in
:mod:`megacann.parallel_state`'s state; this module knows only the kinds and this thread's lane.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence

import torch.distributed as dist

LANE_KINDS = ("tp", "cp", "ep", "dp", "dp_cp", "expert_dp", "expert_dp_cp")
_LANE = threading.local()  # .index: the lane this thread's getters answer for (0 or unset: the groups)


def check_lane_count(count: int) -> None:
    """Refuse a lane count below 1 (1: the groups alone, no duplicates)."""
    if count < 1:
        raise ValueError(f"communication_lanes must be >= 1, got {count}")


@contextlib.contextmanager
def communication_lane(index: int) -> Iterator[None]:
    """Within the block, this thread's getters of the ``LANE_KINDS`` groups answer with lane ``index``'s
    duplicates (lane 0: the groups themselves; an index past the lanes created also gets the groups).
    The same ranks in the same order: only the communicator differs, so work on two lanes may run at once
    from two threads, each lane issuing its collectives in one order on every rank."""
    previous = getattr(_LANE, "index", 0)
    _LANE.index = index
    try:
        yield
    finally:
        _LANE.index = previous


def active_lane(lanes: Sequence[Mapping[str, dist.ProcessGroup]]) -> Mapping[str, dist.ProcessGroup]:
    """This thread's lane among ``lanes`` (lanes 1.., by kind), or nothing on lane 0 or past them."""
    index = getattr(_LANE, "index", 0)
    return lanes[index - 1] if 0 < index <= len(lanes) else {}
