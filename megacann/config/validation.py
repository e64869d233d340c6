"""Recipe validation: choices, sizes that must divide, the parallel layout, pipeline schedule limits."""

from __future__ import annotations

from typing import Any, Optional

from megacann.config.advice import advise
from megacann.config.schema import CHOICES, ConfigError, MegacannConfig


def resolve_parallel_sizes(cfg: MegacannConfig, world_size: Optional[int], source: str) -> None:
    """Fill in world_size / data_parallel_size and check tp x cp x pp x dp = world."""
    d = cfg.distributed
    model = d.tensor_parallel_size * d.pipeline_parallel_size * d.context_parallel_size
    if world_size is not None and d.world_size is not None and world_size != d.world_size:
        raise ConfigError(f"{source}: distributed.world_size is {d.world_size} but {world_size} processes were started")
    world = world_size if world_size is not None else d.world_size
    if d.data_parallel_size is None and world is not None:
        if world % model:
            raise ConfigError(
                f"{source}: world_size {world} is not divisible by tensor_parallel_size "
                f"{d.tensor_parallel_size} x pipeline_parallel_size {d.pipeline_parallel_size} x "
                f"context_parallel_size {d.context_parallel_size} = {model}"
            )
        d.data_parallel_size = world // model
    if d.data_parallel_size is not None:
        product = model * d.data_parallel_size
        if world is not None and product != world:
            raise ConfigError(
                f"{source}: world_size {world} != tensor_parallel_size {d.tensor_parallel_size} x "
                f"pipeline_parallel_size {d.pipeline_parallel_size} x data_parallel_size "
                f"{d.data_parallel_size} x context_parallel_size {d.context_parallel_size} = {product}"
            )
        world = product
    d.world_size = world


def _check_choice(cfg: MegacannConfig, dotted: str, source: str) -> None:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    if obj not in CHOICES[dotted]:
        raise ConfigError(f"{source}: {dotted}: {obj!r} is not one of {', '.join(CHOICES[dotted])}")


BUBBLE_WARNING = 0.25  # warn when a pipeline idles longer than this share of a step


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


def _check_pipeline(cfg: MegacannConfig, source: str) -> None:
    """Schedule constraints and the bubble warning (pipeline_layers and sizes are checked by validate)."""
    pp, vpp, m = (
        cfg.distributed.pipeline_parallel_size,
        cfg.distributed.virtual_pipeline_size or 1,
        cfg.optim.grad_accum_steps,
    )
    if pp < 2:
        return
    if vpp > 1:
        error = interleaved_schedule_error(pp, vpp, m)
        if error:
            raise ConfigError(f"{source}: {error}")
    bubble = pipeline_bubble_fraction(pp, m, vpp)
    if bubble > BUBBLE_WARNING:
        if vpp == 1:
            formula = f"(p - 1)/(m + p - 1) = {pp - 1}/{m + pp - 1}"
            remedy = "or set distributed.virtual_pipeline_size (interleaved 1F1B)"
        else:
            formula = f"((p - 1)/v)/(m + (p - 1)/v) with v {vpp} = {(pp - 1) / vpp:g}/{m + (pp - 1) / vpp:g}"
            remedy = "or a larger distributed.virtual_pipeline_size"
        advise(
            f"{source}: pipeline bubble {bubble:.0%} > {BUBBLE_WARNING:.0%}: pipeline_parallel_size p {pp} with "
            f"optim.grad_accum_steps m {m} micro-batches idles each stage {formula} of a step; use "
            f"grad_accum_steps {_microbatches_for_bubble(pp, vpp)} or more {remedy}"
        )


def _microbatches_for_bubble(pp: int, vpp: int) -> int:
    """The fewest micro-batches that keep the bubble at most BUBBLE_WARNING (a multiple of pp if interleaved)."""
    m = 1
    while pipeline_bubble_fraction(pp, m, vpp) > BUBBLE_WARNING or (vpp > 1 and m % pp):
        m += 1
    return m


def validate(cfg: MegacannConfig, world_size: Optional[int] = None, source: str = "<recipe>") -> None:
    """Check the recipe for consistency; fills derived values (data_parallel_size, world_size)."""
    for dotted in CHOICES:
        _check_choice(cfg, dotted, source)
    m, d, o = cfg.model, cfg.distributed, cfg.optim
    for key in ("hidden_size", "num_layers", "num_attention_heads"):
        if getattr(m, key) is None:
            raise ConfigError(f"{source}: model.{key} is not set (give it inline or through model.config_path)")
    positive = {
        "model.hidden_size": m.hidden_size,
        "model.num_layers": m.num_layers,
        "model.num_attention_heads": m.num_attention_heads,
        "model.num_key_value_heads": m.kv_heads,
        "data.seq_length": cfg.data.seq_length,
        "data.batch_size": cfg.data.batch_size,
        "optim.grad_accum_steps": o.grad_accum_steps,
        "optim.max_steps": o.max_steps,
        "distributed.tensor_parallel_size": d.tensor_parallel_size,
        "distributed.pipeline_parallel_size": d.pipeline_parallel_size,
        "distributed.context_parallel_size": d.context_parallel_size,
        "distributed.expert_parallel_size": d.expert_parallel_size,
        "logging.log_interval": cfg.logging.log_interval,
    }
    for key, value in positive.items():
        if value is None or value < 1:
            raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"{source}: model.hidden_size {m.hidden_size} is not divisible by "
            f"model.num_attention_heads {m.num_attention_heads}"
        )
    if m.num_attention_heads % m.kv_heads:
        raise ConfigError(
            f"{source}: model.num_attention_heads {m.num_attention_heads} is not divisible by "
            f"model.num_key_value_heads {m.kv_heads}"
        )
    tp, pp = d.tensor_parallel_size, d.pipeline_parallel_size
    if m.num_attention_heads % tp:
        raise ConfigError(
            f"{source}: model.num_attention_heads {m.num_attention_heads} is not divisible by "
            f"distributed.tensor_parallel_size {tp}"
        )
    if m.kv_heads % tp and tp % m.kv_heads:
        raise ConfigError(
            f"{source}: model.num_key_value_heads {m.kv_heads} must be a multiple or a divisor of "
            f"distributed.tensor_parallel_size {tp}"
        )
    if m.ffn_size % tp:
        raise ConfigError(
            f"{source}: model.ffn_hidden_size {m.ffn_size} is not divisible by distributed.tensor_parallel_size {tp}"
        )
    vpp = d.virtual_pipeline_size or 1
    if d.virtual_pipeline_size is not None and d.virtual_pipeline_size < 1:
        raise ConfigError(f"{source}: distributed.virtual_pipeline_size must be >= 1, got {d.virtual_pipeline_size}")
    if vpp > 1 and pp < 2:
        raise ConfigError(
            f"{source}: distributed.virtual_pipeline_size {vpp} needs pipeline_parallel_size > 1, got {pp}"
        )
    if d.pipeline_layers is not None:
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in d.pipeline_layers):
            raise ConfigError(
                f"{source}: distributed.pipeline_layers {d.pipeline_layers} must list non-negative layer counts"
            )
        if len(d.pipeline_layers) != pp * vpp or sum(d.pipeline_layers) != m.num_layers:
            raise ConfigError(
                f"{source}: distributed.pipeline_layers {d.pipeline_layers} must list {pp * vpp} stage sizes "
                f"(pipeline_parallel_size {pp} x virtual_pipeline_size {vpp}) summing to model.num_layers "
                f"{m.num_layers}"
            )
    elif m.num_layers % (pp * vpp):
        raise ConfigError(
            f"{source}: model.num_layers {m.num_layers} is not divisible by pipeline_parallel_size {pp} x "
            f"virtual_pipeline_size {vpp} = {pp * vpp} (or give distributed.pipeline_layers)"
        )
    _check_pipeline(cfg, source)
    mode = d.parallel_mode
    if mode == "data" and (tp > 1 or pp > 1):
        raise ConfigError(
            f"{source}: distributed.parallel_mode 'data' needs tensor_parallel_size 1 and pipeline_parallel_size 1, "
            f"got {tp} and {pp} (use 'hybrid')"
        )
    if mode == "tensor" and pp > 1:
        raise ConfigError(
            f"{source}: distributed.parallel_mode 'tensor' needs pipeline_parallel_size 1, got {pp} (use 'hybrid')"
        )
    if mode == "pipeline" and tp > 1:
        raise ConfigError(
            f"{source}: distributed.parallel_mode 'pipeline' needs tensor_parallel_size 1, got {tp} (use 'hybrid')"
        )
    if d.zero_optimization not in (False, True, 0, 1, 2):
        raise ConfigError(
            f"{source}: distributed.zero_optimization must be false, true, 1 or 2, got {d.zero_optimization!r}"
        )
    resolve_parallel_sizes(cfg, world_size, source)
    dp = d.data_parallel_size
    if dp is not None and dp % d.expert_parallel_size:
        raise ConfigError(
            f"{source}: distributed.expert_parallel_size {d.expert_parallel_size} does not divide "
            f"data_parallel_size {dp}"
        )
    if m.type == "gpt" and cfg.data.seq_length > m.max_position_embeddings:
        raise ConfigError(
            f"{source}: data.seq_length {cfg.data.seq_length} exceeds model.max_position_embeddings "
            f"{m.max_position_embeddings} (GPT uses learned positions)"
        )
    if not 0.0 <= o.warmup_ratio < 1.0:
        raise ConfigError(f"{source}: optim.warmup_ratio must be in [0, 1), got {o.warmup_ratio}")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"{source}: optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    if o.lr <= 0:
        raise ConfigError(f"{source}: optim.lr must be positive, got {o.lr}")
    if o.clip_grad < 0:
        raise ConfigError(f"{source}: optim.clip_grad must be >= 0 (0 disables clipping), got {o.clip_grad}")
