"""Static memory of a family that is not a standard decoder (no ``DecoderArch``) but declares its
per-rank parameter formulas (``ModelSpec.rank_parameters``, :class:`~megacann.models.spec.RankParameterFormulas`;
DeepSeek-V4's are in its own files): weights, gradients and optimizer state per pipeline stage, chunk by
chunk as the trainer cuts them. Parameters such a family keeps in fp32 inside a bf16 / fp16 model hold 4
weight bytes and have no master copy. Its activations come from its own formulas
(:mod:`megacann.planning.family_activations`); a family without them is refused by name
(:func:`refuse_activations`) rather than given a wrong number."""

from __future__ import annotations

from typing import Optional

from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.models import get_model_spec
from megacann.models.spec import RankParameterFormulas


def rank_formulas(m: ModelConfig) -> Optional[RankParameterFormulas]:
    """The family's own per-rank parameter formulas when it has no decoder architecture (else None)."""
    spec = get_model_spec(m.type)
    return spec.rank_parameters if spec.architecture is None else None


def refuse_activations(m: ModelConfig) -> None:
    """Refuse, by name, an activation estimate for a family with static formulas only (no
    ``RankParameterFormulas.activations``)."""
    formulas = rank_formulas(m)
    if formulas is not None and formulas.activations is None:
        raise ConfigError(
            f"model.type {m.type!r}: megacann-plan has no activation formulas for this family's blocks yet; "
            "it estimates weights, gradients and optimizer state only"
        )


def static_stages(cfg: MegacannConfig, layout) -> list[dict[str, float]]:
    """Per pipeline stage (stage 0 first) of a recipe whose family gives :func:`rank_formulas`: {"params",
    "expert_params", "weights", "grads", "optimizer", "host_optimizer"} on one of its devices."""
    return [static_stage(cfg, layout, stage) for stage in range(layout.pp)]


def static_stage(cfg: MegacannConfig, layout, stage: int) -> dict[str, float]:
    """One pipeline stage's static memory (:func:`static_stages`), chunk by chunk as the trainer cuts them."""
    from megacann.pipeline import stage_layer_ids
    from megacann.pipeline.placement import LOOP
    from megacann.pipeline.schedule_spec import find_schedule
    from megacann.planning.formulas import MASTER_BYTES, chunk_parameters_per_rank, weight_bytes_per_param
    from megacann.planning.placement import placed_static_bytes

    spec = find_schedule(layout.schedule)
    placement = spec.placement if spec is not None and layout.pp > 1 else LOOP
    chunks, m = placement.chunks(layout.vpp), cfg.model
    formulas = rank_formulas(m)
    widen = 4 - weight_bytes_per_param(cfg)  # an fp32 parameter's extra weight bytes in a bf16 model
    params = experts = unit = fp32 = 0
    for chunk in range(chunks):
        ids = stage_layer_ids(
            m.num_layers, layout.pp, stage, chunks, chunk, cfg.distributed.pipeline_layers, placement=placement
        )
        first = placement.is_model_first(stage, chunk)
        last = placement.is_model_last(layout.pp, stage, chunk, chunks)
        p, e = chunk_parameters_per_rank(cfg, layout.tp, ids, first, last, layout.pp, layout.ep)
        params, experts = params + p, experts + e
        fp32 += formulas.fp32(m, layout.tp, ids, last) if widen else 0
        unit = max([unit] + [sum(formulas.layer(m, layout.tp, i, layout.ep)) for i in ids])
    static = placed_static_bytes(cfg, layout, params, experts, unit)
    static["weights"] += widen * fp32
    static["optimizer"] -= MASTER_BYTES * (fp32 / layout.zero_shards if layout.zero else fp32)
    return {"params": params, "expert_params": experts, **static}
