"""Checkpoints of LoRA runs on one process: merged into their base as a full model, or the adapters alone
in Hugging Face PEFT's format.

A LoRA run's checkpoint holds the adapters (``model/<layer>.adapter.lora_A`` / ``lora_B``, whole tensors)
and, in ``megacann.json``, ``base`` (the frozen weights: ``model.init_from``'s kind, path, fingerprint and
a checkpoint's step, or the seed they were drawn from) and ``lora`` (rank, alpha, dropout, targets). The
base is found again from that reference (``--base`` points elsewhere, e.g. after a move) and must have
the recorded fingerprint.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from megacann.checkpoint.metadata import CheckpointError, model_config_of, read_info
from megacann.config import MegacannConfig, ModelConfig
from megacann.interop.export import cast_weights, write_consolidated_export, write_hf_export
from megacann.interop.full_state import full_state_dict, load_full_state_dict_, whole_model_on_meta
from megacann.interop.names import INFO_FILE
from megacann.interop.peft import ADAPTER_SLOT, write_peft_adapter
from megacann.interop.reading import read_checkpoint_weights, read_weights
from megacann.interop.sources import CHECKPOINT, HUGGINGFACE, fingerprint, resolve_weight_source
from megacann.interop.tokenizer import source_tokenizer
from megacann.layers import deferred_initialization
from megacann.layers.lora import LoRAConfig, attach_lora, lora_adapters
from megacann.models.spec import ChunkPlacement, get_model_spec


def read_lora_checkpoint(source: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole adapter tensors of a LoRA checkpoint (or output directory) and its ``megacann.json``."""
    found = resolve_weight_source(source, "source")
    info = read_info(found.path) if found.kind == CHECKPOINT else {}
    if info.get("base") is None:
        raise CheckpointError(
            f"{source}: not a checkpoint of a LoRA run (no base reference in its {INFO_FILE}); full models "
            "convert with consolidate / to-hf"
        )
    tensors, _ = read_checkpoint_weights(found.path)
    return tensors, info


def lora_settings(info: dict[str, Any]) -> LoRAConfig:
    lora = info["lora"]
    targets = lora["target_modules"]
    return LoRAConfig(
        rank=lora["rank"],
        alpha=lora["alpha"],
        dropout=lora["dropout"],
        target_modules=targets if isinstance(targets, str) else tuple(targets),
    )


def _seed_base(model_cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The whole base drawn from ``seed`` by the family's own initialisation (one process, CPU)."""
    spec = get_model_spec(model_cfg.type)
    cfg = MegacannConfig(model=model_cfg, seed=seed)
    spec.fill_defaults(model_cfg)
    model = spec.build(cfg, ChunkPlacement(tuple(range(model_cfg.num_layers))), "cpu")
    return full_state_dict([model])  # unpadded, as checkpoints store them


def read_base(info: dict[str, Any], base: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The whole weights of a LoRA checkpoint's base: from ``base`` if given, else the recorded path; a
    base whose fingerprint differs from the recorded one is refused."""
    reference, model_cfg = info["base"], model_config_of(info)
    if reference["kind"] == "seed" and base is None:
        return _seed_base(model_cfg, reference["seed"])
    path = base or reference.get("path")
    if not path or not os.path.isdir(path):
        raise CheckpointError(f"the base {path!r} of this LoRA checkpoint is not a directory; pass --base DIR")
    found = resolve_weight_source(path, "--base")
    if fingerprint(found) != reference.get("fingerprint"):
        raise CheckpointError(
            f"{path} is not the base this LoRA checkpoint was trained on (fingerprint {fingerprint(found)}, "
            f"recorded {reference.get('fingerprint')} for {reference.get('path')})"
        )
    tensors, _ = read_weights(found.path)
    return tensors


@torch.no_grad()
def merge_adapter_tensors(
    base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], model_cfg: ModelConfig, lora: LoRAConfig
) -> dict[str, torch.Tensor]:
    """``base`` with every adapter's ``scaling * B A`` added to its layer's weight (in fp32, cast back), and
    the persistent buffers the LoRA checkpoint holds (e.g. MoE routing biases moved during training)."""
    meta = whole_model_on_meta(get_model_spec(model_cfg.type), model_cfg)
    attach_lora(meta, lora, strict=False)
    merged = dict(base)
    used = set()
    for layer, adapter in lora_adapters(meta):
        keys = (f"{layer}{ADAPTER_SLOT}lora_A", f"{layer}{ADAPTER_SLOT}lora_B")
        missing = [k for k in keys if k not in adapters]
        if missing:
            raise CheckpointError(f"the LoRA checkpoint lacks {missing[0]!r}")
        used.update(keys)
        weight = base[f"{layer}.weight"]
        delta = adapter.full_delta(adapters[keys[0]].float(), adapters[keys[1]].float())
        merged[f"{layer}.weight"] = (weight.float() + delta).to(weight.dtype)
    carried = [name for name in adapters if ADAPTER_SLOT not in name]  # buffers the run kept (routing biases)
    merged.update({name: adapters[name] for name in carried})
    unused = sorted(set(adapters) - used - set(carried))
    if unused:
        raise CheckpointError(f"adapter tensors {unused[:3]} match no layer of model.type {model_cfg.type!r}")
    return merged


def merge_lora_checkpoint(
    source: str,
    out: str,
    dtype: Optional[str] = None,
    to: str = "megacann",
    base: Optional[str] = None,
    log: Callable[[str], None] = print,
) -> str:
    """LoRA checkpoint -> a full model (adapters merged into the base): a consolidated directory
    (``to="megacann"``) or a Hugging Face directory (``to="hf"``), with the run's tokenizer."""
    adapters, info = read_lora_checkpoint(source)
    model_cfg = model_config_of(info)
    merged = cast_weights(merge_adapter_tensors(read_base(info, base), adapters, model_cfg, lora_settings(info)), dtype)
    write = write_hf_export if to == "hf" else write_consolidated_export
    write(merged, model_cfg, out, source_tokenizer(source, model_cfg, log))
    return out


def export_peft_checkpoint(source: str, out: str, dtype: Optional[str] = None, base: Optional[str] = None) -> str:
    """LoRA checkpoint -> a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``),
    to load with ``peft.PeftModel.from_pretrained`` on the base exported to Hugging Face."""
    adapters, info = read_lora_checkpoint(source)
    reference = info["base"]
    name = base or (reference.get("path") if reference.get("kind") == HUGGINGFACE else None)
    write_peft_adapter(cast_weights(adapters, dtype), model_config_of(info), lora_settings(info), out, name)
    return out


def read_full_model(source: str, base: Optional[str] = None) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Whole weights and model config of any source on one process; a LoRA checkpoint comes merged into
    its base."""
    found = resolve_weight_source(source, "source")
    if found.kind == CHECKPOINT and read_info(found.path).get("base") is not None:
        adapters, info = read_lora_checkpoint(found.path)
        model_cfg = model_config_of(info)
        return merge_adapter_tensors(read_base(info, base), adapters, model_cfg, lora_settings(info)), model_cfg
    return read_weights(found.path)


def is_lora_checkpoint(source: str) -> bool:
    """Whether ``source`` resolves to the checkpoint of a LoRA run (adapters on a recorded base)."""
    found = resolve_weight_source(source, "source")
    return found.kind == CHECKPOINT and read_info(found.path).get("base") is not None


def build_adapted_model(
    source: str, precision: str = "fp32", device: Optional[str] = None, base: Optional[str] = None
) -> torch.nn.Module:
    """The whole model of a LoRA checkpoint with its adapters attached and active, not merged (as
    ``peft.PeftModel.from_pretrained`` loads them), on one process."""
    adapters, info = read_lora_checkpoint(source)
    model_cfg = model_config_of(info)
    tensors = {**read_base(info, base), **adapters}
    return _built(tensors, model_cfg, precision, device, source, lora_settings(info))


def build_full_model(
    source: str, precision: str = "fp32", device: Optional[str] = None, base: Optional[str] = None
) -> torch.nn.Module:
    """The whole model of any source (a LoRA checkpoint merged) built by its family, on one process."""
    tensors, model_cfg = read_full_model(source, base)
    return _built(tensors, model_cfg, precision, device, source)


def _built(
    tensors: dict[str, torch.Tensor],
    model_cfg: ModelConfig,
    precision: str,
    device: Optional[str],
    source: str,
    lora: Optional[LoRAConfig] = None,
) -> torch.nn.Module:
    """``model_cfg``'s model built by its family with ``tensors`` loaded (with ``lora``'s adapters, whose
    tensors ``tensors`` holds)."""
    model_cfg.precision = precision
    spec = get_model_spec(model_cfg.type)
    cfg = MegacannConfig(model=model_cfg)
    spec.fill_defaults(model_cfg)
    with deferred_initialization(weights_loaded=True):  # every weight is loaded below: none is drawn
        model = spec.build(cfg, ChunkPlacement(tuple(range(model_cfg.num_layers))), device)
        if lora is not None:
            attach_lora(model, lora, strict=False)
    load_full_state_dict_([model], tensors, source)
    return model
