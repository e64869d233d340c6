"""What a pipeline layout allows: stage sizes, the schedule named, the interleaved schedule's micro-batch rule,
the bubble."""

from __future__ import annotations

from typing import Optional

from megacann.config import ConfigError, MegacannConfig

BUBBLE_ADVICE = 0.25  # advise when a pipeline idles longer than this share of a step

SCHEDULES = ("1f1b", "interleaved", "zb1p", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")  # two chunks per stage in a V (megacann.pipeline.v_schedules)


def chunks_per_stage(schedule: Optional[str], virtual_size: Optional[int]) -> int:
    """Model chunks each pipeline stage holds: 2 for the V-shaped schedules, else virtual_pipeline_size."""
    return 2 if schedule in V_SHAPED else virtual_size or 1


def loss_stage(schedule: Optional[str], pipeline_size: int) -> int:
    """The pipeline stage that computes the loss (its last model chunk holds the head): stage 0 in the V
    placement (its chunk 1, :mod:`megacann.pipeline.v_schedules`), else the last stage."""
    return 0 if schedule in V_SHAPED and pipeline_size > 1 else pipeline_size - 1


def schedule_error(schedule: Optional[str], pipeline_size: int, virtual_size: Optional[int]) -> Optional[str]:
    """Why ``distributed.pipeline_schedule`` cannot run with this layout, or None when it can."""
    if schedule is None:
        return None
    if schedule not in SCHEDULES:
        return f"distributed.pipeline_schedule must be one of {', '.join(SCHEDULES)} (or unset), got {schedule!r}"
    vpp = virtual_size or 1
    if pipeline_size < 2:
        return f"distributed.pipeline_schedule {schedule!r} needs pipeline_parallel_size > 1, got {pipeline_size}"
    if schedule in V_SHAPED and vpp not in (1, 2):
        return (
            f"distributed.pipeline_schedule {schedule!r} runs two model chunks per stage placed as a V, but "
            f"distributed.virtual_pipeline_size is {vpp}: unset it or set it to 2"
        )
    if schedule == "interleaved" and vpp < 2:
        return (
            f"distributed.pipeline_schedule 'interleaved' needs distributed.virtual_pipeline_size >= 2, "
            f"got {virtual_size}"
        )
    if schedule in ("1f1b", "zb1p") and vpp > 1:
        return (
            f"distributed.pipeline_schedule {schedule!r} runs one model chunk per stage, but "
            f"distributed.virtual_pipeline_size is {vpp}: unset it, or use 'interleaved'"
        )
    return None


def pipeline_bubble_fraction(pipeline_size: int, num_microbatches: int, virtual_size: Optional[int] = None) -> float:
    """Share of a step a pipeline stage idles in (1F1B): (p - 1)/(m + p - 1); interleaving divides the
    bubble time by v: ((p - 1)/v)/(m + (p - 1)/v)."""
    bubble = (pipeline_size - 1) / (virtual_size or 1)
    return bubble / (num_microbatches + bubble)


def interleaved_schedule_error(pipeline_size: int, virtual_size: int, num_microbatches: int) -> Optional[str]:
    """Why the interleaved 1F1B schedule cannot run this many micro-batches, or None when it can."""
    p, m = pipeline_size, num_microbatches
    if m % p == 0:
        return None
    lower, upper = m - m % p, m + p - m % p
    options = f"{lower} or {upper}" if lower else f"{upper}"
    return (
        f"the interleaved 1F1B schedule (virtual_pipeline_size {virtual_size}) needs the number of "
        f"micro-batches, optim.grad_accum_steps, to be a multiple of pipeline_parallel_size {p}, got {m}: "
        f"use {options}, or no virtual stages (1F1B takes any number)"
    )


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
    if schedule in V_SHAPED:
        return f"{chunks} chunks per stage of pipeline_schedule {schedule}, in model order"
    return f"virtual_pipeline_size {chunks}"


def _check_v_shaped(cfg: MegacannConfig, source: str) -> None:
    """The V's own rules (:func:`megacann.pipeline.v_schedules.v_schedule_error`). Everything the last
    stage's head serves elsewhere runs on stage 0's chunk 1 (:func:`loss_stage`): tied embeddings and
    multi-token prediction (their copies of the embedding sit beside it and that rank sums the gradients
    itself, :func:`megacann.optimizer.finalize.reduce_shared_embedding_grads`) and preference training
    (``train_mode: dpo``: its sequence log-probabilities are read there)."""
    from megacann.pipeline.v_schedules import v_schedule_error

    d = cfg.distributed
    error = v_schedule_error(d.pipeline_schedule, d.pipeline_parallel_size, cfg.optim.grad_accum_steps)
    if error:
        raise ConfigError(f"{source}: {error}")


def validate_pipeline_config(cfg: MegacannConfig, source: str = "<recipe>") -> None:
    """Raise ConfigError for a layout the schedules cannot run (the checks of :func:`check_pipeline_config`
    without its advice, which simulates the schedule: the layout search validates many)."""
    _check_stage_sizes(cfg, source)
    d = cfg.distributed
    error = schedule_error(d.pipeline_schedule, d.pipeline_parallel_size, d.virtual_pipeline_size)
    if error:
        raise ConfigError(f"{source}: {error}")
    pp, vpp, m = d.pipeline_parallel_size, d.virtual_pipeline_size or 1, cfg.optim.grad_accum_steps
    if pp < 2:
        return
    if d.pipeline_schedule in V_SHAPED:
        _check_v_shaped(cfg, source)
    elif vpp > 1:
        error = interleaved_schedule_error(pp, vpp, m)
        if error:
            raise ConfigError(f"{source}: {error}")


def check_pipeline_config(cfg: MegacannConfig, source: str = "<recipe>") -> list[str]:
    """Raise ConfigError for a layout the schedules cannot run; return advice (a large bubble) as text."""
    validate_pipeline_config(cfg, source)
    from megacann.pipeline.overlap import check_overlap_config  # dualpipev's overlap key

    notes = check_overlap_config(cfg, source)
    d = cfg.distributed
    pp, vpp, m = d.pipeline_parallel_size, d.virtual_pipeline_size or 1, cfg.optim.grad_accum_steps
    if pp < 2:
        return notes
    if d.pipeline_schedule in ("zb1p", *V_SHAPED):
        from megacann.pipeline.simulate import schedule_summary  # the simulator builds on these rules

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
