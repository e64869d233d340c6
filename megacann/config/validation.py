"""Recipe validation that needs only the recipe: choices, sizes that must divide, the parallel layout.

What only a model family or the pipeline schedules know is checked by them
(``megacann.models.prepare_model_config``, ``megacann.pipeline.check_pipeline_config``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

from megacann.config.fp8_keys import check_fp8_keys
from megacann.config.generation_eval import check_generation_eval
from megacann.config.offload_keys import check_offload_keys
from megacann.config.rl_keys import check_rl_section
from megacann.config.schema import CHOICES, MODE_DEFAULTS, ConfigError, MegacannConfig
from megacann.config.zero import check_zero_keys, check_zero_layout

# Keys the schema names whose feature is not built yet: anything but their inert value is refused with the
# reason, rather than accepted and ignored. Each feature's work removes its entry; tests/test_config_keys.py
# checks that every other key is read by the code it names.
NOT_YET_IMPLEMENTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "data.json_key": (
        lambda v: v == "text",
        "training reads prepared .bin/.idx data or SFT JSONL records; the text key of raw JSONL is a "
        "preprocessing option (megacann-preprocess --json_key)",
    ),
}


# Numeric keys and the values they accept (None, where allowed, is checked by the type, not here).
def _at_least(low: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= low), f">= {low}"


def _above(low: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v > low), f"> {low}"


def _fraction() -> tuple[Callable[[Any], bool], str]:
    return (lambda v: 0.0 <= v < 1.0), "in [0, 1)"


RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model.ffn_hidden_size": _at_least(1),
    "model.vocab_size": _at_least(1),
    "model.max_position_embeddings": _at_least(1),
    "model.make_vocab_size_divisible_by": _at_least(1),
    "model.norm_eps": _above(0),
    "model.rope_theta": _above(0),
    "model.init_method_std": _above(0),
    "model.hidden_dropout": _fraction(),
    "model.attention_dropout": _fraction(),
    "data.num_workers": _at_least(0),
    "data.tokenizer_vocab_size": _at_least(258),  # a byte-level BPE: 256 bytes + EOS + pad
    "optim.weight_decay": _at_least(0),
    "optim.adam_beta1": _fraction(),
    "optim.adam_beta2": _fraction(),
    "optim.adam_eps": _above(0),
    "optim.warmup_steps": _at_least(0),
    "optim.initial_loss_scale": _above(0),
    "optim.loss_scale_window": _at_least(1),
    "optim.min_loss_scale": _above(0),
    "distributed.world_size": _at_least(1),
    "distributed.data_parallel_size": _at_least(1),
    "distributed.virtual_pipeline_size": _at_least(1),
    "distributed.bucket_size_mb": _above(0),
    "distributed.timeout_minutes": _above(0),
    "logging.ckpt_interval": _at_least(0),
    "logging.keep_last": _at_least(1),
    "logging.hf_save_interval": _at_least(0),
    "logging.eval_interval": _at_least(0),
    "logging.eval_iters": _at_least(1),
    "precision.fp8_exclude_first_layers": _at_least(0),
    "precision.fp8_exclude_last_layers": _at_least(0),
    "precision.fp8_amax_history_len": _at_least(1),
}


def check_ranges(cfg: MegacannConfig, source: str) -> None:
    for key, (accepts, expected) in RANGES.items():
        value = _value_of(cfg, key)
        if value is not None and not isinstance(value, bool) and not accepts(value):
            raise ConfigError(f"{source}: {key} must be {expected}, got {value!r}")


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


def check_context_parallel(cfg: MegacannConfig, source: str) -> None:
    """What splitting every sequence over ``context_parallel_size`` ranks needs of the recipe."""
    d, m = cfg.distributed, cfg.model
    cp, tp, seq = d.context_parallel_size, d.tensor_parallel_size, cfg.data.seq_length
    if cp == 1:
        return
    if seq % (2 * cp):
        raise ConfigError(
            f"{source}: data.seq_length {seq} must be divisible by 2 x distributed.context_parallel_size {cp} = "
            f"{2 * cp} (each cp rank holds two of 2 x cp equal chunks, for balanced causal attention)"
        )
    if d.sequence_parallel_active and (seq // cp) % tp:
        raise ConfigError(
            f"{source}: sequence parallelism splits each cp rank's {seq // cp} tokens (data.seq_length {seq} / "
            f"context_parallel_size {cp}) over tensor_parallel_size {tp}: they must divide"
        )
    if m.attention_dropout:
        raise ConfigError(
            f"{source}: model.attention_dropout {m.attention_dropout} is not supported with "
            f"distributed.context_parallel_size {cp}: set it to 0"
        )
    if m.num_attention_heads is None:  # from model.init_from, checked once read
        return
    heads = m.num_attention_heads // tp
    if d.context_parallel_algo == "ulysses" and heads % cp:
        raise ConfigError(
            f"{source}: distributed.context_parallel_algo 'ulysses' splits each tensor-parallel rank's {heads} "
            f"attention heads (num_attention_heads {m.num_attention_heads} / tp {tp}) over "
            f"context_parallel_size {cp}: they must divide; use 'ring' or 'allgather'"
        )


def require_context_parallel_algo(cfg: MegacannConfig, source: str, algo: str, needs: str) -> None:
    """A family whose layers run under context parallelism with ``algo`` only refuses any other, naming
    ``model.type`` and why (``needs``: what its layers read that only ``algo`` holds on every rank)."""
    d = cfg.distributed
    if d.context_parallel_size > 1 and d.context_parallel_algo != algo:
        raise ConfigError(
            f"{source}: distributed.context_parallel_algo {d.context_parallel_algo!r} is refused for model.type "
            f"{cfg.model.type} at context_parallel_size {d.context_parallel_size}: {needs}, which only {algo!r} "
            f"holds on every rank (set distributed.context_parallel_algo={algo})"
        )


def _check_choice(cfg: MegacannConfig, dotted: str, source: str) -> None:
    obj = _value_of(cfg, dotted)
    if obj not in CHOICES[dotted]:
        raise ConfigError(f"{source}: {dotted}: {obj!r} is not one of {', '.join(CHOICES[dotted])}")


def check_family_choices(model: Any, source: str) -> None:
    """A family's own keys that name one of a few choices (``choices`` in the field's metadata)."""
    for f in dataclasses.fields(model):
        allowed = f.metadata.get("choices")
        if allowed and getattr(model, f.name) not in allowed:
            raise ConfigError(
                f"{source}: model.{f.name}: {getattr(model, f.name)!r} is not one of {', '.join(allowed)}"
            )


def fill_mode_defaults(cfg: MegacannConfig) -> None:
    """Give the optimizer settings the recipe left unset (None) their ``train_mode``'s default:
    ``MODE_DEFAULTS`` (SFT: lr 1e-5, warmup_ratio 0.05; pretraining: 3e-4, 0)."""
    for key, value in MODE_DEFAULTS[cfg.train_mode].items():
        if getattr(cfg.optim, key) is None:
            setattr(cfg.optim, key, value)


MODEL_SIZE_KEYS = ("hidden_size", "num_layers", "num_attention_heads")  # what no default can fill


def architecture_pending(cfg: MegacannConfig) -> bool:
    """True while the architecture is still to come from ``model.init_from`` (a size is unset): the model's
    checks then wait until ``megacann.interop.apply_model_source`` has read it (``prepare_recipe``)."""
    return bool(cfg.model.init_from) and any(getattr(cfg.model, key) is None for key in MODEL_SIZE_KEYS)


def check_model_sizes(cfg: MegacannConfig, source: str) -> None:
    """The model's sizes are set and positive."""
    m = cfg.model
    for key in MODEL_SIZE_KEYS:
        if getattr(m, key) is None:
            raise ConfigError(
                f"{source}: model.{key} is not set (give it inline, through model.config_path or by model.init_from)"
            )
    positive = {
        "model.hidden_size": m.hidden_size,
        "model.num_layers": m.num_layers,
        "model.num_attention_heads": m.num_attention_heads,
        "model.num_key_value_heads": m.kv_heads,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")


def check_model_shape(cfg: MegacannConfig, source: str) -> None:
    """Heads divide the hidden size and the tensor-parallel ranks; the sequence fits the positions."""
    m, tp = cfg.model, cfg.distributed.tensor_parallel_size
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
    if cfg.data.seq_length > m.max_position_embeddings:
        raise ConfigError(
            f"{source}: data.seq_length {cfg.data.seq_length} exceeds model.max_position_embeddings "
            f"{m.max_position_embeddings}, the longest sequence the model is made for: shorten data.seq_length "
            "or raise model.max_position_embeddings (LLaMA: with rope_scaling to extend a trained model)"
        )
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


def validate(cfg: MegacannConfig, world_size: Optional[int] = None, source: str = "<recipe>") -> None:
    """Check the recipe for consistency; fills derived values (data_parallel_size, world_size) and the
    train_mode's optimizer defaults."""
    for dotted in CHOICES:
        _check_choice(cfg, dotted, source)
    check_family_choices(cfg.model, source)
    fill_mode_defaults(cfg)
    refuse_unimplemented(cfg, source)
    check_ranges(cfg, source)
    d, o = cfg.distributed, cfg.optim
    pending = architecture_pending(cfg)
    if not pending:
        check_model_sizes(cfg, source)
    positive = {
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
    if not pending:
        check_model_shape(cfg, source)
    tp, pp = d.tensor_parallel_size, d.pipeline_parallel_size
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
    check_zero_keys(cfg, source)
    resolve_parallel_sizes(cfg, world_size, source)
    check_context_parallel(cfg, source)
    check_zero_layout(cfg, source)
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
    check_training_section(cfg, source)
    check_offload_keys(cfg, source)
    if o.clip_grad < 0:
        raise ConfigError(f"{source}: optim.clip_grad must be >= 0 (0 disables clipping), got {o.clip_grad}")
    check_profiler_window(cfg.logging.profiler, o.max_steps, source)
    check_dpo_section(cfg, source)
    check_rl_section(cfg, source)
    check_fp8_keys(cfg, source)
    check_generation_eval(cfg.generation_eval, cfg.experiment.imports, d.pipeline_parallel_size, source)


def check_dpo_section(cfg: MegacannConfig, source: str) -> None:
    """``train_mode: dpo``: whole pairs per micro-batch, a usable reference, sensible loss settings."""
    if cfg.train_mode != "dpo":
        return
    p = cfg.dpo
    if cfg.data.batch_size % 2:
        raise ConfigError(
            f"{source}: data.batch_size {cfg.data.batch_size} must be even with train_mode dpo: a micro-batch "
            "holds whole preference pairs (a chosen and a rejected sequence each)"
        )
    if cfg.data.weights is not None:
        raise ConfigError(f"{source}: data.weights is refused with train_mode dpo: the files' pairs are concatenated")
    if not p.beta > 0:
        raise ConfigError(f"{source}: dpo.beta must be positive, got {p.beta!r}")
    if not 0.0 <= p.label_smoothing < 0.5:
        raise ConfigError(f"{source}: dpo.label_smoothing must be in [0, 0.5), got {p.label_smoothing!r}")
    weight = p.sft_loss_weight
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (math.isfinite(weight) and weight >= 0):
        raise ConfigError(
            f"{source}: dpo.sft_loss_weight must be a finite number >= 0 (0 turns the chosen answers' NLL term "
            f"off), got {p.sft_loss_weight!r}"
        )
    if p.label_smoothing and p.loss_type == "ipo":
        raise ConfigError(f"{source}: dpo.label_smoothing applies to loss_type sigmoid or simpo, not ipo")
    if p.reference == "adapters_off" and not cfg.lora:
        raise ConfigError(f"{source}: dpo.reference adapters_off needs lora: true (the base under the adapters)")


PROFILER_KEYS = ("start_step", "end_step")


def check_profiler_window(window: Optional[dict], max_steps: int, source: str) -> None:
    """``logging.profiler`` is null or ``{start_step: A, end_step: B}`` with 1 <= A <= B <= max_steps."""
    if window is None:
        return
    where = f"{source}: logging.profiler"
    unknown = sorted(set(window) - set(PROFILER_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected {{start_step: A, end_step: B}}")
    missing = [k for k in PROFILER_KEYS if k not in window]
    if missing:
        raise ConfigError(f"{where}: {' and '.join(missing)} missing; expected {{start_step: A, end_step: B}}")
    for key in PROFILER_KEYS:
        value = window[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{where}.{key} must be a positive integer (a step number, from 1), got {value!r}")
    start, end = window["start_step"], window["end_step"]
    if start > end:
        raise ConfigError(f"{where}: start_step {start} is after end_step {end}")
    if end > max_steps:
        raise ConfigError(
            f"{where}.end_step {end} is past optim.max_steps {max_steps}: the trace would never be written"
        )


def check_training_section(cfg: MegacannConfig, source: str) -> None:
    """The ``training`` section: skip limits, the loss spike detector and the hang watchdog."""
    t = cfg.training
    if t.max_skipped_steps < 1:
        raise ConfigError(f"{source}: training.max_skipped_steps must be >= 1, got {t.max_skipped_steps}")
    if t.loss_spike_window < 1:
        raise ConfigError(f"{source}: training.loss_spike_window must be >= 1, got {t.loss_spike_window}")
    for key, value in (("loss_spike_factor", t.loss_spike_factor), ("hang_factor", t.hang_factor)):
        if not (value == 0 or value > 1):  # also refuses nan
            raise ConfigError(f"{source}: training.{key} must be 0 (off) or a multiple above 1, got {value}")
    if not t.hang_min_seconds >= 0:
        raise ConfigError(f"{source}: training.hang_min_seconds must be >= 0, got {t.hang_min_seconds}")
    if t.skip_loss_spikes and not t.loss_spike_factor:
        raise ConfigError(
            f"{source}: training.skip_loss_spikes needs training.loss_spike_factor (the multiple of the running "
            "mean that counts as a spike), which is 0 (off)"
        )
