"""A recipe checked whole, once, before anything starts: the recipe's own rules (with the architecture
of ``model.init_from``), the model family's defaults and checks, the fine-tuning settings (LoRA), the
pipeline layout's rules. Used by the trainer, ``megacann-train`` (before any rank
starts), the dry run and the planner."""

from __future__ import annotations

from typing import Optional

from megacann import ops
from megacann.config import ConfigError, MegacannConfig, apply_model_source, validate
from megacann.config.advice import advise
from megacann.models import ModelSpec, prepare_model_config
from megacann.pipeline import check_pipeline_config
from megacann.training.finetune import check_finetune_config


def prepare_recipe(
    cfg: MegacannConfig,
    world_size: Optional[int] = None,
    source: str = "<recipe>",
    spec: Optional[ModelSpec] = None,
) -> tuple[ModelSpec, list[str]]:
    """Validate ``cfg`` and fill what it leaves to others (sizes, family defaults). Returns the model family
    and the advice (e.g. a large pipeline bubble), which is also printed once, on rank 0; raises
    ConfigError for what cannot run."""
    apply_model_source(cfg, source)
    validate(cfg, world_size=world_size, source=source)
    p = cfg.precision
    try:
        ops.check_op_names("precision.fp32_ops", p.fp32_ops)
        if not isinstance(p.fused_ops, bool):
            ops.check_op_names("precision.fused_ops", p.fused_ops)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{source}: {err}") from None
    spec = prepare_model_config(cfg, spec, source)
    check_finetune_config(cfg, spec, source)
    advice = check_pipeline_config(cfg, source)
    for line in advice:
        advise(line)
    return spec, advice
