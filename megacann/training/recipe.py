"""A recipe checked whole, once, before anything starts: the recipe's own rules (with the architecture
of ``model.init_from``), the model family's defaults and checks, the fine-tuning settings (LoRA), Hugging
Face saves during training, the pipeline layout's rules. Used by the trainer, ``megacann-train`` (before any rank
starts), the dry run and the planner."""

from __future__ import annotations

import difflib
from typing import Optional

from megacann import ops
from megacann.config import ConfigError, MegacannConfig, validate
from megacann.config.advice import advise
from megacann.interop.model_source import apply_model_source
from megacann.layers.compile import DEFAULT_BACKEND, available_backends
from megacann.models import ModelSpec, prepare_model_config
from megacann.pipeline import check_pipeline_config
from megacann.training.finetune import check_finetune_config
from megacann.training.hf_save import check_hf_save_config


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
    check_compile(cfg, source)
    check_tp_comm_overlap(cfg, source)
    spec = prepare_model_config(cfg, spec, source)
    check_finetune_config(cfg, spec, source)
    check_hf_save_config(cfg, spec, source)
    advice = check_pipeline_config(cfg, source)
    for line in advice:
        advise(line)
    return spec, advice


def compile_backend(cfg: MegacannConfig) -> Optional[str]:
    """The torch.compile backend ``precision.compile`` asks for (true: the default one), or None."""
    value = cfg.precision.compile
    if value is False:
        return None
    return DEFAULT_BACKEND if value is True else value


def check_compile(cfg: MegacannConfig, source: str) -> None:
    """``precision.compile``: false, true or a backend torch.compile knows. Every layout compiles: the
    tensor-parallel collectives are traced into the block's graph, the ring's point-to-point transfers and
    the expert dispatch graph-break (they run eagerly between compiled regions)."""
    value = cfg.precision.compile
    if value is False:
        return
    if not isinstance(value, (bool, str)):
        raise ConfigError(
            f"{source}: precision.compile must be false, true or a torch.compile backend name, got {value!r}"
        )
    if isinstance(value, str):
        backends = available_backends()
        if value not in backends:
            close = difflib.get_close_matches(value, backends, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{source}: precision.compile: {value!r} is not a torch.compile backend{hint}; known: {', '.join(backends)}"
            )


def check_tp_comm_overlap(cfg: MegacannConfig, source: str) -> None:
    """``distributed.tp_comm_overlap`` overlaps the sequence-parallel all-gather / reduce-scatter of the
    column-parallel layers: without sequence parallelism over more than one rank there is none to overlap."""
    d = cfg.distributed
    if d.tp_comm_overlap and not d.sequence_parallel_active:
        raise ConfigError(
            f"{source}: distributed.tp_comm_overlap needs distributed.sequence_parallel: true and "
            f"distributed.tensor_parallel_size > 1 (got sequence_parallel {d.sequence_parallel}, "
            f"tensor_parallel_size {d.tensor_parallel_size}): it overlaps their all-gather and reduce-scatter"
        )
