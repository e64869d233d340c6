"""Recipe validation that needs only the recipe: choices, sizes that must divide, the parallel layout.

What only a model family or the pipeline schedules know is checked by them
(``megacann.models.prepare_model_config``, ``megacann.pipeline.check_pipeline_config``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from megacann.config.schema import CHOICES, MODE_DEFAULTS, ConfigError, MegacannConfig

# Keys the schema names whose feature is not built yet: anything but their inert value is refused with the
# reason, rather than accepted and ignored. Each feature's work removes its entry; tests/test_config_keys.py
# checks that every other key is read by the code it names.
NOT_YET_IMPLEMENTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "distributed.context_parallel_size": (
        lambda v: v == 1,
        "context parallelism is not implemented yet: no layer would split the sequence, so the ranks of a "
        "context-parallel group would repeat each other's work",
    ),
    "distributed.expert_parallel_size": (
        lambda v: v == 1,
        "expert parallelism needs a mixture-of-experts model family, which is not implemented yet",
    ),
    "data.json_key": (
        lambda v: v == "text",
        "training reads prepared .bin/.idx data or SFT JSONL records; the text key of raw JSONL is a "
        "preprocessing option (megacann-preprocess --json_key)",
    ),
}


def _value_of(cfg: MegacannConfig, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def refuse_unimplemented(cfg: MegacannConfig, source: str) -> None:
    for key, (inert, reason) in NOT_YET_IMPLEMENTED.items():
        value = _value_of(cfg, key)
        if not inert(value):
            raise ConfigError(f"{source}: {key}: {value!r} is refused: {reason}")


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
    obj = _value_of(cfg, dotted)
    if obj not in CHOICES[dotted]:
        raise ConfigError(f"{source}: {dotted}: {obj!r} is not one of {', '.join(CHOICES[dotted])}")


def fill_mode_defaults(cfg: MegacannConfig) -> None:
    """Give the optimizer settings the recipe left unset (None) their ``train_mode``'s default:
    ``MODE_DEFAULTS`` (SFT: lr 1e-5, warmup_ratio 0.05; pretraining: 3e-4, 0)."""
    for key, value in MODE_DEFAULTS[cfg.train_mode].items():
        if getattr(cfg.optim, key) is None:
            setattr(cfg.optim, key, value)


def validate(cfg: MegacannConfig, world_size: Optional[int] = None, source: str = "<recipe>") -> None:
    """Check the recipe for consistency; fills derived values (data_parallel_size, world_size) and the
    train_mode's optimizer defaults."""
    for dotted in CHOICES:
        _check_choice(cfg, dotted, source)
    fill_mode_defaults(cfg)
    refuse_unimplemented(cfg, source)
    m, d, o = cfg.model, cfg.distributed, cfg.optim
    for key in ("hidden_size", "num_layers", "num_attention_heads"):
        if getattr(m, key) is None:
            raise ConfigError(
                f"{source}: model.{key} is not set (give it inline, through model.config_path or by model.init_from)"
            )
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
    if not 0.0 <= o.warmup_ratio < 1.0:
        raise ConfigError(f"{source}: optim.warmup_ratio must be in [0, 1), got {o.warmup_ratio}")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"{source}: optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    if o.lr <= 0:
        raise ConfigError(f"{source}: optim.lr must be positive, got {o.lr}")
    if o.clip_grad < 0:
        raise ConfigError(f"{source}: optim.clip_grad must be >= 0 (0 disables clipping), got {o.clip_grad}")
