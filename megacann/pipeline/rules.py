"""What a pipeline layout allows: stage sizes, the schedule named (each registered schedule checks its own
layout and micro-batch count, :mod:`megacann.pipeline.schedule_spec`), the bubble."""

from __future__ import annotations

from typing import Optional

from megacann.config import ConfigError, MegacannConfig
from megacann.pipeline.interleaved import interleaved_schedule_error  # noqa: F401  (importable from here as ever)
from megacann.pipeline.overlap import check_overlap_config
from megacann.pipeline.placement import LOOP
from megacann.pipeline.schedule_spec import find_schedule, schedule_for, unknown_schedule_error
from megacann.pipeline.simulate import schedule_summary

BUBBLE_ADVICE = 0.25  # advise when a pipeline idles longer than this share of a step


def chunks_per_stage(schedule: Optional[str], virtual_size: Optional[int]) -> int:
    """Model chunks each pipeline stage holds: the schedule's placement's count (2 for the V), else
    virtual_pipeline_size."""
    spec = find_schedule(schedule)
    return (spec.placement if spec else LOOP).chunks(virtual_size)


def loss_stage(schedule: Optional[str], pipeline_size: int) -> int:
    """The pipeline stage that computes the loss (its last model chunk holds the head): the schedule's
    placement's (stage 0 in the V, :mod:`megacann.pipeline.placement`), else the last stage."""
    spec = find_schedule(schedule)
    if spec is None or pipeline_size < 2:
        return pipeline_size - 1
    return spec.placement.loss_stage(pipeline_size)


def schedule_error(schedule: Optional[str], pipeline_size: int, virtual_size: Optional[int]) -> Optional[str]:
    """Why ``distributed.pipeline_schedule`` cannot run with this layout, or None when it can."""
    if schedule is None:
        return None
    spec = find_schedule(schedule)
    if spec is None:
        return unknown_schedule_error(schedule)
    if pipeline_size < 2:
        return f"distributed.pipeline_schedule {schedule!r} needs pipeline_parallel_size > 1, got {pipeline_size}"
    return spec.layout_error(pipeline_size, virtual_size)


def pipeline_bubble_fraction(pipeline_size: int, num_microbatches: int, virtual_size: Optional[int] = None) -> float:
    """Share of a step a pipeline stage idles in (1F1B): (p - 1)/(m + p - 1); interleaving divides the
    bubble time by v: ((p - 1)/v)/(m + (p - 1)/v)."""
    bubble = (pipeline_size - 1) / (virtual_size or 1)
    return bubble / (num_microbatches + bubble)


def microbatches_for_bubble(pp: int, vpp: int) -> int:
    """The fewest micro-batches that keep the bubble at most BUBBLE_ADVICE (a multiple of pp if interleaved)."""
    m = 1
    while pipeline_bubble_fraction(pp, m, vpp) > BUBBLE_ADVICE or (vpp > 1 and m % pp):
        m += 1
    return m


def _check_stage_sizes(cfg: MegacannConfig, source: str) -> None:
    d, layers = cfg.distributed, cfg.model.num_layers
    pp = d.pipeline_parallel_size
    if d.virtual_pipeline_size is not None and d.virtual_pipeline_size < 1:
        raise ConfigError(f"{source}: distributed.virtual_pipeline_size must be >= 1, got {d.virtual_pipeline_size}")
    vpp = chunks_per_stage(d.pipeline_schedule, d.virtual_pipeline_size)
    if vpp > 1 and pp < 2:
        raise ConfigError(
            f"{source}: distributed.virtual_pipeline_size {vpp} needs pipeline_parallel_size > 1, got {pp}"
        )
    if d.pipeline_layers is not None:
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in d.pipeline_layers):
            raise ConfigError(
                f"{source}: distributed.pipeline_layers {d.pipeline_layers} must list non-negative layer counts"
            )
        if len(d.pipeline_layers) != pp * vpp or sum(d.pipeline_layers) != layers:
            raise ConfigError(
                f"{source}: distributed.pipeline_layers {d.pipeline_layers} must list {pp * vpp} stage sizes "
                f"(pipeline_parallel_size {pp} x {_chunks_name(d.pipeline_schedule, vpp)}) summing to "
                f"model.num_layers {layers}"
            )
    elif layers % (pp * vpp):
        raise ConfigError(
            f"{source}: model.num_layers {layers} is not divisible by pipeline_parallel_size {pp} x "
            f"{_chunks_name(d.pipeline_schedule, vpp)} = {pp * vpp} (or give distributed.pipeline_layers)"
        )


def _chunks_name(schedule: Optional[str], chunks: int) -> str:
    spec = find_schedule(schedule)
    if spec is not None and spec.placement.fixed_chunks:
        return f"{chunks} chunks per stage of pipeline_schedule {schedule}, in model order"
    return f"virtual_pipeline_size {chunks}"


def validate_pipeline_config(cfg: MegacannConfig, source: str = "<recipe>") -> None:
    """Raise ConfigError for a layout the schedules cannot run (the checks of :func:`check_pipeline_config`
    without its advice, which simulates the schedule: the layout search validates many): the stage sizes,
    then the schedule's own rules (:class:`~megacann.pipeline.schedule_spec.ScheduleSpec` ``layout_error``
    and ``micro_batch_error``). In the V everything the last stage's head serves elsewhere runs on stage 0's
    chunk 1 (:func:`loss_stage`): tied embeddings and multi-token prediction (their copies of the embedding
    sit beside it and that rank sums the gradients itself,
    :func:`megacann.optimizer.finalize.reduce_shared_embedding_grads`) and preference training
    (``train_mode: dpo``: its sequence log-probabilities are read there)."""
    _check_stage_sizes(cfg, source)
    d = cfg.distributed
    error = schedule_error(d.pipeline_schedule, d.pipeline_parallel_size, d.virtual_pipeline_size)
    if error:
        raise ConfigError(f"{source}: {error}")
    if d.pipeline_parallel_size < 2:
        return
    spec = schedule_for(d.pipeline_schedule, d.virtual_pipeline_size)
    error = spec.micro_batch_error(d.pipeline_parallel_size, d.virtual_pipeline_size, cfg.optim.grad_accum_steps)
    if error:
        raise ConfigError(f"{source}: {error}")


def check_pipeline_config(cfg: MegacannConfig, source: str = "<recipe>") -> list[str]:
    """Raise ConfigError for a layout the schedules cannot run; return advice (a large bubble) as text."""
    validate_pipeline_config(cfg, source)
    notes = check_overlap_config(cfg, source)
    d = cfg.distributed
    pp, vpp, m = d.pipeline_parallel_size, d.virtual_pipeline_size or 1, cfg.optim.grad_accum_steps
    if pp < 2:
        return notes
    spec = schedule_for(d.pipeline_schedule, d.virtual_pipeline_size)
    if spec.split_backward:  # its bubble simulated (no closed form)
        bubble = schedule_summary(pp, m, vpp, d.pipeline_schedule)[0]
        if bubble <= BUBBLE_ADVICE:
            return notes
        return notes + [
            f"{source}: pipeline bubble {bubble:.0%} > {BUBBLE_ADVICE:.0%}: {d.pipeline_schedule} with "
            f"pipeline_parallel_size {pp} "
            f"and optim.grad_accum_steps {m} micro-batches idles each stage that share of a step (simulated, "
            "forward, input gradient and weight gradient taking equal time); use more grad_accum_steps"
        ]
    bubble = pipeline_bubble_fraction(pp, m, vpp)
    if bubble <= BUBBLE_ADVICE:
        return notes
    if vpp == 1:
        formula = f"(p - 1)/(m + p - 1) = {pp - 1}/{m + pp - 1}"
        remedy = "or set distributed.virtual_pipeline_size (interleaved 1F1B)"
    else:
        formula = f"((p - 1)/v)/(m + (p - 1)/v) with v {vpp} = {(pp - 1) / vpp:g}/{m + (pp - 1) / vpp:g}"
        remedy = "or a larger distributed.virtual_pipeline_size"
    return notes + [
        f"{source}: pipeline bubble {bubble:.0%} > {BUBBLE_ADVICE:.0%}: pipeline_parallel_size p {pp} with "
        f"optim.grad_accum_steps m {m} micro-batches idles each stage {formula} of a step; use "
        f"grad_accum_steps {microbatches_for_bubble(pp, vpp)} or more {remedy}"
    ]
