"""A pipeline schedule as one registered spec: what every part of megacann asks of a schedule by its name.

``distributed.pipeline_schedule`` names a :class:`ScheduleSpec`; the partitioner, the executor and the
simulator ask its :class:`~megacann.pipeline.placement.Placement` where chunks sit, the recipe check asks
its ``layout_error`` and ``micro_batch_error``, the planner, the dry run and the overlap ask whether it
splits the backward and pairs actions. The built-in schedules are registered by
:mod:`megacann.pipeline.builtin_schedules` (1F1B, interleaved 1F1B, zb1p, zbv, dualpipev); a new one costs
one file defining a spec and one :func:`register_schedule` call (docs/pipeline.md, "Adding a schedule").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from megacann.pipeline.actions import Action, Forward
from megacann.pipeline.placement import Placement

# (stages, stage, micro-batches, virtual size, forward only) -> that stage's plan
PlanBuilder = Callable[[int, int, int, Optional[int], bool], list[Action]]
# (stages, virtual size) -> why the layout cannot run the schedule, or None
LayoutCheck = Callable[[int, Optional[int]], Optional[str]]
# (stages, virtual size, micro-batches) -> why the schedule cannot run this many micro-batches, or None
MicroBatchCheck = Callable[[int, Optional[int], int], Optional[str]]
# (stages, stage, micro-batches) -> each forward that runs at once with the backward it maps to
PairsOf = Callable[[int, int, int], dict[Forward, Action]]


def _no_error(*_: object) -> Optional[str]:
    return None


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule.

    ``build`` makes one stage's plan (stages > 1; one stage always runs plain gradient accumulation);
    ``layout_error`` and ``micro_batch_error`` say why a recipe's layout or micro-batch count cannot run
    (messages naming the recipe keys); ``label`` is what the dry run prints (``{chunks}``: chunks per
    stage, ``{overlap}``: how paired actions run); ``split_backward``: backwards run as B and W (the
    weight layers defer their gradients, the planner and the dry run simulate its bubble);
    ``pairs``: the forward/backward pairs the executor may run at once (DualPipeV's overlap), or None;
    ``min_virtual_size``: the fewest chunks per stage the layout search tries it with."""

    name: str
    placement: Placement
    build: PlanBuilder
    label: str
    split_backward: bool = False
    layout_error: LayoutCheck = _no_error
    micro_batch_error: MicroBatchCheck = _no_error
    pairs: Optional[PairsOf] = None
    min_virtual_size: int = 1

    def chunks_per_stage(self, virtual_size: Optional[int]) -> int:
        """Model chunks each stage holds under this schedule for ``distributed.virtual_pipeline_size``."""
        return self.placement.chunks(virtual_size)


_REGISTRY: dict[str, ScheduleSpec] = {}


def register_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    """Make ``spec`` a value of ``distributed.pipeline_schedule`` (a name registered twice is refused)."""
    if spec.name in _REGISTRY:
        raise ValueError(f"pipeline schedule {spec.name!r} is registered already")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_schedule(name: str) -> None:
    """Forget schedule ``name`` (tests that register one of their own clean up with this)."""
    _REGISTRY.pop(name, None)


def registered_schedules() -> tuple[str, ...]:
    """The names of the registered schedules, in registration order."""
    return tuple(_REGISTRY)


def unknown_schedule_error(name: object) -> str:
    return f"distributed.pipeline_schedule must be one of {', '.join(registered_schedules())} (or unset), got {name!r}"


def get_schedule(name: str) -> ScheduleSpec:
    """The spec registered as ``name``; ValueError naming the registered ones for any other."""
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(unknown_schedule_error(name))
    return spec


def schedule_for(name: Optional[str], virtual_size: Optional[int]) -> ScheduleSpec:
    """The schedule a recipe runs: the one named, or (key unset) 1F1B, interleaved 1F1B with virtual stages."""
    if name is None:
        name = "interleaved" if (virtual_size or 1) > 1 else "1f1b"
    return get_schedule(name)


def find_schedule(name: Optional[str]) -> Optional[ScheduleSpec]:
    """The spec registered as ``name``, or None (the key unset, or a name validation will refuse)."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def splits_backward(name: Optional[str]) -> bool:
    """Schedule ``name`` runs backwards as B and W (False for the key unset or an unknown name)."""
    spec = find_schedule(name)
    return spec is not None and spec.split_backward
