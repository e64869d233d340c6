"""Fine-tuning a built model: start from ``model.init_from``, attach LoRA adapters, and say what trains.

Works on any model family: weights are loaded by parameter name into whatever chunks the family's spec
built, and adapters go on every ``ColumnParallelLinear`` / ``RowParallelLinear`` and MoE expert
projection whose name ``lora_target_modules`` picks (:mod:`megacann.layers.lora`), sharded like their
layer. With ``lora: true`` every other parameter is frozen (``requires_grad=False``): the optimizer, its
gradient buffers and ZeRO's shards then hold nothing for it, and checkpoints store only the adapters plus
a reference to the base (:func:`base_reference`), checked again on resume.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.collectives import all_reduce_if_parallel
from megacann.config import ConfigError, MegacannConfig
from megacann.config.advice import advise
from megacann.interop.full_state import whole_model_on_meta
from megacann.interop.peft import peft_refusal
from megacann.layers import parameter_seed
from megacann.layers.lora import LoRAConfig, attach_lora, count_parameters, init_adapters_
from megacann.layers.sharding import get_sharding
from megacann.models import ModelSpec

LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules")


def lora_config(cfg: MegacannConfig, source: str = "<recipe>") -> LoRAConfig:
    """The recipe's LoRA settings; a ConfigError names the key that is wrong."""
    targets = cfg.lora_target_modules
    try:
        return LoRAConfig(
            rank=cfg.lora_rank,
            alpha=cfg.lora_alpha,
            dropout=cfg.lora_dropout,
            target_modules=targets if isinstance(targets, str) else tuple(targets),
        )
    except ValueError as err:
        key = next((k for k in LORA_KEYS if k[len("lora_") :] in str(err)), "lora")
        raise ConfigError(f"{source}: {key}: {err}") from None


def check_finetune_config(cfg: MegacannConfig, spec: ModelSpec, source: str = "<recipe>") -> None:
    """LoRA settings valid and every target matching a layer of the whole model (checked on the meta
    device, before anything starts); LoRA keys set without ``lora: true`` are pointed out."""
    defaults = MegacannConfig()
    if not cfg.lora:
        changed = [k for k in LORA_KEYS if getattr(cfg, k) != getattr(defaults, k)]
        if changed:
            advise(f"{', '.join(changed)} take effect only with lora: true (it is false)")
        return
    _adapted_on_meta(cfg, spec, source)


def _adapted_on_meta(cfg: MegacannConfig, spec: ModelSpec, source: str = "<recipe>") -> torch.nn.Module:
    """The whole model with the recipe's adapters, on the meta device (names and shapes only)."""
    lora = lora_config(cfg, source)
    refusal = peft_refusal(spec.name, lora.target_modules)
    if refusal is not None:
        raise ConfigError(f"{source}: lora_target_modules: {refusal}")
    model = whole_model_on_meta(spec, dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or 128))
    try:
        attach_lora(model, lora, strict=True)
    except ValueError as err:
        raise ConfigError(f"{source}: lora_target_modules: {err}") from None
    return model


def lora_parameter_counts(cfg: MegacannConfig, spec: ModelSpec) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model with the recipe's adapters (``lora: true``; the
    vocabulary unpadded), without building it: what the dry run shows."""
    return count_parameters(_adapted_on_meta(cfg, spec))


def base_reference(cfg: MegacannConfig) -> dict[str, Any]:
    """What a LoRA checkpoint records about its frozen base: ``model.init_from``'s identity (kind, path,
    fingerprint, a checkpoint's step), or the seed the base was drawn from."""
    if cfg.model.init_from:
        from megacann.interop.sources import resolve_weight_source, source_identity

        return source_identity(resolve_weight_source(cfg.model.init_from))
    return {"kind": "seed", "seed": cfg.seed, "path": None}


def prepare_model_chunks(cfg: MegacannConfig, chunks: list[torch.nn.Module]) -> Optional[dict[str, Any]]:
    """Load ``model.init_from`` into this rank's chunks, then (``lora: true``) attach the adapters, drawn
    from the seed by name (the same on every layout), and freeze the rest. Returns the base reference of a
    LoRA run (its checkpoints hold only adapters), else None."""
    if cfg.model.init_from:
        from megacann.interop.reading import load_source_weights
        from megacann.interop.sources import resolve_weight_source

        load_source_weights(chunks, resolve_weight_source(cfg.model.init_from), cfg.model)
    if not cfg.lora:
        return None
    lora = lora_config(cfg)
    for chunk in chunks:  # strict per stage is wrong (a stage may hold none); the whole model was checked
        attach_lora(chunk, lora, freeze_base=True, strict=False)
        init_adapters_(chunk, functools.partial(parameter_seed, cfg.seed))
    return base_reference(cfg)


# -- what trains ----------------------------------------------------------------------------------------


def _stored_once(chunks: list[torch.nn.Module]):
    from megacann.checkpoint.state import storage_name

    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if storage_name(name, param) == name:  # not a pipeline stage's copy of a tied embedding
                yield param


def _summed(values: list[int], group) -> list[int]:
    summed = all_reduce_if_parallel(torch.tensor(values, dtype=torch.float64), group)
    return [int(v) for v in summed.tolist()]


def parameter_counts(chunks: list[torch.nn.Module]) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model (every stage and every expert-parallel rank's
    experts, unsharded, without vocabulary padding). Collective over the pipeline- and expert-parallel
    groups."""
    dense, expert = [0, 0], [0, 0]
    for param in _stored_once(chunks):
        n = math.prod(get_sharding(param).logical_shape)
        counts = expert if get_sharding(param).expert else dense
        counts[0] += n if param.requires_grad else 0
        counts[1] += n
    expert = _summed(expert, ps.get_expert_model_parallel_group())
    trainable, total = _summed([dense[0] + expert[0], dense[1] + expert[1]], ps.get_pipeline_model_parallel_group())
    return trainable, total


def memory_line(chunks: list[torch.nn.Module], optimizer) -> str:
    """One line for the log: trainable and total parameters, and the bytes of parameters, gradients and
    optimizer state on the largest rank (measured from the tensors). Collective over the world."""
    from megacann.optimizer.memory import optimizer_memory, storage_bytes

    trainable, total = parameter_counts(chunks)
    held = optimizer_memory(optimizer)
    mine = torch.tensor(
        [float(storage_bytes(_stored_once(chunks))), float(held["grads"]), float(held["optimizer_states"])],
        dtype=torch.float64,
    )
    if dist.is_initialized():
        all_reduce_if_parallel(mine, dist.group.WORLD, op=dist.ReduceOp.MAX)
    params, grads, states = (v / 2**20 for v in mine.tolist())
    return (
        f"parameters: {trainable:,} trainable of {total:,} ({100.0 * trainable / max(total, 1):.2f}%); per rank "
        f"(max): weights {params:.2f} MiB, gradient buffers {grads:.2f} MiB, optimizer state {states:.2f} MiB"
    )


def describe_base(reference: Optional[dict[str, Any]], cfg: MegacannConfig) -> Optional[str]:
    """A log line naming the frozen base of a LoRA run."""
    if reference is None:
        return None
    if reference["kind"] == "seed":
        return f"LoRA rank {cfg.lora_rank} on a frozen base drawn from seed {reference['seed']}"
    step = f", step {reference['step']}" if "step" in reference else ""
    return (
        f"LoRA rank {cfg.lora_rank} on the frozen base {reference['path']} ({reference['kind']}{step}, "
        f"fingerprint {reference['fingerprint']}); checkpoints hold the adapters only"
    )
