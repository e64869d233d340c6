"""What ``train_mode: grpo`` adds to a device's memory: the KL's reference policy and the generation cache.

The reference is a frozen copy of the starting weights when ``rl.reference`` resolves to ``copy`` (counted
in the stage totals, like DPO's); the rollouts' generation cache is allocated while generating, for the rows
one generation call holds (``data.batch_size x optim.grad_accum_steps``) and at most ``data.seq_length - 1``
slots a row (a prompt leaves ``rl.max_new_tokens`` of the sequence; the last new token is never fed back):
each layer what its family declares it keeps (:mod:`megacann.planning.generation`), this rank's share, on
the pipeline stage that holds the most.
"""

from __future__ import annotations

from megacann.config import MegacannConfig
from megacann.config.rl_keys import reference_kind
from megacann.models.decode_cache import LayerCache
from megacann.pipeline import stage_layer_ids
from megacann.planning.generation import decode_layout, layout_bytes, layout_summary


def rollout_cache_shape(cfg: MegacannConfig) -> tuple[int, int]:
    """(rows, slots) of a rollout generation at most: ``data.batch_size x optim.grad_accum_steps`` rows, and
    the longest prompt allowed (``data.seq_length - rl.max_new_tokens``) plus the new tokens but the last."""
    return cfg.data.batch_size * cfg.optim.grad_accum_steps, cfg.data.seq_length - 1


def largest_stage_layout(cfg: MegacannConfig) -> list[LayerCache]:
    """The decode cache layout of the pipeline stage whose cache is the largest (the whole model at pp 1)."""
    layout, d = decode_layout(cfg), cfg.distributed
    rows, slots = rollout_cache_shape(cfg)
    stages = [
        [
            layout[i]
            for i in stage_layer_ids(cfg.model.num_layers, d.pipeline_parallel_size, stage, None, 0, d.pipeline_layers)
        ]
        for stage in range(d.pipeline_parallel_size)
    ]
    return max(stages, key=lambda kinds: layout_bytes(cfg, kinds, d.tensor_parallel_size, rows, slots))


def generation_cache_bytes(cfg: MegacannConfig) -> int:
    """Bytes of the rollouts' generation cache on one device (its largest allocation)."""
    return layout_bytes(cfg, largest_stage_layout(cfg), cfg.distributed.tensor_parallel_size, *rollout_cache_shape(cfg))


def rl_memory_lines(cfg: MegacannConfig, reference_gb: str) -> list[str]:
    """The reference policy's line (``reference_gb``: the copy's GB on its largest stage) and the cache's."""
    kind = reference_kind(cfg)
    reference = {
        "none": "GRPO reference: none (rl.kl_coef 0 or rl.reference none)",
        "copy": f"GRPO reference: a frozen copy of the starting weights, sharded like the policy: {reference_gb} GB "
        "per device (weights only; in the total)",
        "adapters_off": "GRPO reference: the policy's frozen base with the adapters off: no memory of its own",
    }[kind]
    return [reference, generation_cache_line(cfg)]


def generation_cache_line(cfg: MegacannConfig) -> str:
    """The rollouts' generation cache on one device, kind by kind (also printed by ``--dry_run`` for a family
    without a memory plan)."""
    rows, slots = rollout_cache_shape(cfg)
    stage, tp = largest_stage_layout(cfg), cfg.distributed.tensor_parallel_size
    total = generation_cache_bytes(cfg)
    return (
        f"GRPO generation cache: {total / 1e9:.2f} GB per device ({rows} rows x {slots} slots, {cfg.model.precision}, "
        f"tp {tp}: {layout_summary(cfg, stage, tp, rows, slots)} ({total:,} bytes in all); allocated while "
        "generating, when no training activation is held: not in the total)"
    )
