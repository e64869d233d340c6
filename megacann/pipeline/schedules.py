"""Forward/backward schedules over the micro-batches of one step.

Every schedule has the same signature and returns the :class:`~megacann.models.step_loss.LossTotals` of the
micro-batches it ran on this rank (the token-loss sum is zero off the last pipeline stage); what a chunk's
backward starts from, the gradient-sync context and ``trace=`` are the executor's
(:mod:`megacann.pipeline.executor`).

All schedules run a plan (:mod:`megacann.pipeline.plan`) with one executor, :func:`run_plan`: no
pipelining is a plan without transfers, 1F1B and interleaved 1F1B add the transfers of
:mod:`megacann.pipeline.p2p`, the split-backward schedules (zb1p, zbv, dualpipev) split
backwards into B and W (:mod:`megacann.pipeline.split_backward`), the V-shaped ones
(:mod:`megacann.pipeline.v_schedules`, on the V :mod:`~megacann.pipeline.placement`) hold two chunks per
stage in a V and list each step's transfers, both ways, in a ``VExchange``. Which schedule, its plan, its
placement and its pairs come from its registered spec (:mod:`megacann.pipeline.schedule_spec`). ``forward_only=True`` runs forwards
alone (evaluation).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

from megacann import parallel_state as ps
from megacann.config import MegacannConfig
from megacann.models.contract import LossTotals
from megacann.models.spec import decoder_forward_step
from megacann.pipeline import p2p
from megacann.pipeline.executor import ForwardStep, StepOptions, run_plan
from megacann.pipeline.overlap import overlap_wanted, resolve_overlap
from megacann.pipeline.plan import build_plan
from megacann.pipeline.schedule_spec import schedule_for

if TYPE_CHECKING:
    from typing_extensions import Unpack  # a torch dependency; annotations only

ForwardBackward = Callable[..., LossTotals]


def forward_backward_no_pipelining(
    model_chunks: list[torch.nn.Module],
    micro_batches: list[dict],
    *,
    loss_normalizer: float,
    forward_only: bool = False,
    **options: Unpack[StepOptions],
) -> LossTotals:
    """Plain gradient accumulation over micro-batches on one stage. ``options``: :class:`StepOptions`
    (``loss_scale``, ``forward_step``, ``timeline``, ``grad_sync_context``, ``trace``), as :func:`run_plan`."""
    unknown = sorted(set(options) - set(StepOptions.__annotations__))
    if unknown:  # run_plan would take its own pipeline keywords (tensor_shape, placement, ...) silently
        raise TypeError(
            f"forward_backward_no_pipelining() got unexpected keyword arguments {unknown}; "
            f"besides its own it takes {sorted(StepOptions.__annotations__)}"
        )
    if len(model_chunks) != 1:
        raise ValueError(f"no pipelining runs one model chunk, got {len(model_chunks)}")
    plan = build_plan(1, 0, len(micro_batches), forward_only=forward_only)
    return run_plan(
        plan, model_chunks, micro_batches, loss_normalizer=loss_normalizer, forward_only=forward_only, **options
    )


def forward_backward_pipelining(
    model_chunks: list[torch.nn.Module],
    micro_batches: list[dict],
    *,
    loss_normalizer: float,
    forward_only: bool = False,
    tensor_shape: tuple[int, ...],
    schedule: Optional[str] = None,
    overlap: Union[bool, str] = False,
    probe: Optional[list] = None,
    **options: Unpack[StepOptions],
) -> LossTotals:
    """1F1B over this rank's pipeline, interleaved when the rank holds several model chunks (one per
    virtual stage; then the number of micro-batches must be a multiple of the pipeline size), or the
    ``schedule`` named (``distributed.pipeline_schedule``). ``overlap`` (``distributed.dualpipev_overlap``
    where the recipe allows it, else False): dualpipev runs its pairs at once (auto: where this run can,
    see :func:`~megacann.pipeline.overlap.resolve_overlap`). ``options``: :class:`StepOptions`, as
    :func:`run_plan`."""
    stages, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    virtual = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    spec = schedule_for(schedule, virtual)
    if len(model_chunks) != spec.chunks_per_stage(virtual):
        raise ValueError(
            f"this rank holds {len(model_chunks)} model chunks, the schedule runs {spec.chunks_per_stage(virtual)}"
            f" (virtual_pipeline_size {virtual}, pipeline_schedule {schedule}): "
            "build them with megacann.pipeline.build_model_chunks"
        )
    plan = build_plan(stages, stage, len(micro_batches), virtual, forward_only, schedule)
    pairs = None
    overlapping = spec.pairs is not None and not forward_only and overlap is not False
    if overlapping and resolve_overlap(overlap, ps.communication_lanes(), model_chunks):
        pairs = spec.pairs(stages, stage, len(micro_batches))
    return run_plan(
        plan,
        model_chunks,
        micro_batches,
        loss_normalizer=loss_normalizer,
        forward_only=forward_only,
        tensor_shape=tensor_shape,
        placement=spec.placement,
        overlap_pairs=pairs,
        probe=probe,
        **options,
    )


def get_forward_backward_func(cfg: MegacannConfig, forward_step: ForwardStep = decoder_forward_step) -> ForwardBackward:
    """The schedule the recipe asks for (no pipelining, 1F1B, interleaved 1F1B with virtual_pipeline_size,
    or ``distributed.pipeline_schedule``), running chunks through ``forward_step`` (the model family's)."""
    d = cfg.distributed
    if d.pipeline_parallel_size == 1:
        return functools.partial(forward_backward_no_pipelining, forward_step=forward_step)
    shape = p2p.activation_shape(
        cfg.data.batch_size,
        cfg.data.seq_length,
        cfg.model.stage_hidden_size,
        d.sequence_parallel_active,
        d.tensor_parallel_size,
        d.context_parallel_size,
    )
    return functools.partial(
        forward_backward_pipelining,
        tensor_shape=shape,
        forward_step=forward_step,
        schedule=d.pipeline_schedule,
        overlap=d.dualpipev_overlap if overlap_wanted(cfg) else False,
    )
