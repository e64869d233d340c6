"""LoRA adapters in Hugging Face PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``).

The files load with ``peft.PeftModel.from_pretrained(hf_model, dir)`` on the base exported by
:func:`megacann.interop.hf.save_pretrained_hf`, and back into megacann with :func:`load_peft_adapter`.

Names come from the model family's Hugging Face adapter (``HFAdapter.linear_parts``): any family that
has one gets PEFT adapters. For LLaMA, megacann's ``layers.3.self_attn.q_proj.adapter.lora_A`` is PEFT's
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``. A LoRA on a fused projection
(``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up) is split by output rows: each part gets its rows of
``B`` and its ``A``, the one ``A`` of the fused matrix when it is shared (target ``qkv_proj``), or the part's
own block of ``A`` (targets ``q_proj``, ``v_proj``…). Either way ``B_part A_part x`` is exactly the fused
adapter's output on that part's rows. Reading does the reverse for the model at hand, fused or not.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.config import ModelConfig
from megacann.config.advice import advise
from megacann.errors import MegacannError
from megacann.interop.full_state import gather_full_tensor, whole_model_on_meta
from megacann.interop.hf import save_safetensors
from megacann.interop.names import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from megacann.layers.lora import (
    ALL_PROJECTIONS,
    FUSED_PROJECTIONS,
    HF_PROJECTIONS,
    LoRAConfig,
    adapter_layout,
    attach_lora,
    expert_layers_elsewhere,
    lora_adapters,
    lora_parameters,
    resolve_target,
)
from megacann.layers.sharding import get_sharding, shard_tensor
from megacann.models.spec import get_model_spec

PEFT_PREFIX = "base_model.model."
ADAPTER_SLOT = ".adapter."
EXPERT_SLOT = ".experts."

# PEFT settings megacann's LoRA does not implement: loading an adapter that uses them would be wrong.
_UNSUPPORTED = {
    "bias": ("none", None),
    "use_dora": (False, None),
    "use_rslora": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "layers_to_transform": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
}


class PeftFormatError(MegacannError, ValueError):
    """An adapter directory megacann cannot read, or tensors that do not fit the LoRA settings."""


def _split_name(name: str) -> tuple[str, str]:
    """``layers.0.self_attn.q_proj.adapter.lora_A`` -> (``layers.0.self_attn.q_proj``, ``lora_A``)."""
    layer, _, param = name.partition(ADAPTER_SLOT)
    return layer, param


def _linear_parts(cfg: ModelConfig, what: str):
    """The family's ``linear_parts`` (megacann weight name -> Hugging Face names and rows)."""
    spec = get_model_spec(cfg.type)
    if spec.hf is None or spec.hf.linear_parts is None:
        raise PeftFormatError(
            f"{what}: model family {cfg.type!r} has no Hugging Face adapter naming its projections "
            "(HFAdapter.linear_parts), so its LoRA adapters have no PEFT names"
        )
    return spec.hf.linear_parts


def peft_refusal(family: str, targets: Iterable[str]) -> Optional[str]:
    """Why PEFT cannot hold the LoRAs ``targets`` name on model family ``family`` (None: it can), e.g.
    gpt-oss's stacked experts: such a LoRA run is refused at start-up, its export here."""
    hf = get_model_spec(family).hf
    return hf.peft_refusal(tuple(targets)) if hf is not None and hf.peft_refusal is not None else None


def layer_parts(layer: str, cfg: ModelConfig, what: str = "PEFT") -> list[tuple[str, Optional[int]]]:
    """(Hugging Face module name, output rows or None) of each part of megacann linear layer ``layer``."""
    parts = _linear_parts(cfg, what)(f"{layer}.weight", cfg)
    return [(name.removesuffix(".weight"), rows) for name, rows in parts]


def _peft_key(module: str, which: str) -> str:
    """PEFT's key of ``which`` (lora_A / lora_B) on Hugging Face module ``module``."""
    return f"{PEFT_PREFIX}{module}.{which}.weight"


def _matched_parts(layer: str, cfg: ModelConfig, what: str) -> list[tuple[str, str, Optional[int]]]:
    """(megacann part name, Hugging Face module, rows) of each part of ``layer``, in order."""
    leaf = layer.rsplit(".", 1)[-1]
    ours = FUSED_PROJECTIONS.get(leaf, (leaf,))
    theirs = layer_parts(layer, cfg, what)
    if len(theirs) != len(ours):
        raise PeftFormatError(
            f"{what}: {layer} has parts {list(ours)} but the Hugging Face adapter names {len(theirs)} for it"
        )
    return [(part, module, rows) for part, (module, rows) in zip(ours, theirs)]


# -- writing ----------------------------------------------------------------------------------------


def lora_full_tensors(chunks: Iterable[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Whole adapter tensors of this rank's chunks, by megacann name (collective over tensor parallel)."""
    return {name: gather_full_tensor(p) for chunk in chunks for name, p in lora_parameters(chunk)}


def to_peft_tensors(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """Whole megacann adapter tensors -> PEFT's names and shapes (fused projections split by rows)."""
    out: dict[str, torch.Tensor] = {}
    layers = sorted({_split_name(n)[0] for n in tensors if ADAPTER_SLOT in n})
    for layer in layers:
        a, b = tensors[f"{layer}{ADAPTER_SLOT}lora_A"], tensors[f"{layer}{ADAPTER_SLOT}lora_B"]
        parts = _matched_parts(layer, cfg, "PEFT export")
        target = resolve_target(layer.rsplit(".", 1)[-1], len(parts), lora.target_modules)
        if target is None:
            raise PeftFormatError(f"{layer} holds a LoRA but target_modules {list(lora.target_modules)} do not name it")
        chosen = [
            (module, rows if rows is not None else b.shape[0])
            for (_, module, rows), s in zip(parts, target.selected)
            if s
        ]
        rows = [size for _, size in chosen]
        if sum(rows) != b.shape[0] or a.shape[0] != target.groups * lora.rank:
            raise PeftFormatError(
                f"{layer}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit rank {lora.rank} on "
                f"parts {list(target.selected_parts)} with rows {rows}"
            )
        a_parts = [a] * len(rows) if target.shared else list(a.split(lora.rank, dim=0))
        regroup = get_model_spec(cfg.type).hf.lora_b_to_hf or (lambda _name, b_rows, _cfg: b_rows)
        for (module, _), a_part, b_part in zip(chosen, a_parts, b.split(rows, dim=0)):
            if _peft_key(module, "lora_A") in out:
                raise PeftFormatError(f"{layer}: Hugging Face's {module} holds a LoRA of another layer already")
            out[_peft_key(module, "lora_A")] = a_part.contiguous().clone()
            out[_peft_key(module, "lora_B")] = regroup(f"{layer}.weight", b_part, cfg).contiguous().clone()
    return out


def peft_config_dict(
    lora: LoRAConfig, target_modules: list[str], base_model_name_or_path: Optional[str] = None
) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def _note_expert_targets(tensors: Mapping[str, torch.Tensor], lora: LoRAConfig) -> None:
    """Say so when experts' adapters are a mix that PEFT cannot put on fused expert weights: transformers 5
    fuses each layer's experts (gate and up in one tensor), and PEFT converts per-expert adapters onto it
    only for gate + up + down, or down alone."""
    adapted = {_split_name(n)[0].rsplit(".", 1)[-1] for n in tensors if EXPERT_SLOT in n and ADAPTER_SLOT in n}
    gate_up = resolve_target("gate_up_proj", 2, lora.target_modules) if "gate_up_proj" in adapted else None
    if gate_up is not None and (not all(gate_up.selected) or "down_proj" not in adapted):
        parts = [*gate_up.selected_parts, *(["down_proj"] if "down_proj" in adapted else [])]
        advise(
            f"the experts' LoRA covers {'+'.join(parts)}: megacann reads this PEFT adapter back, but PEFT on "
            "transformers 5 (fused experts) loads expert adapters only on gate+up+down or down alone"
        )


def write_peft_adapter(
    tensors: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    lora: LoRAConfig,
    path: str,
    base_model_name_or_path: Optional[str] = None,
) -> None:
    """Write whole megacann adapter tensors (held by one process) as a PEFT adapter directory."""
    _linear_parts(cfg, path)
    refusal = peft_refusal(cfg.type, lora.target_modules)
    if refusal is not None:
        raise PeftFormatError(f"{path}: {refusal}")
    peft_tensors = to_peft_tensors(tensors, cfg, lora)
    if not peft_tensors:
        raise PeftFormatError(f"{path}: no LoRA tensors to write (is a LoRA attached to the model?)")
    found = {key[len(PEFT_PREFIX) :].rsplit(".", 2)[0].rsplit(".", 1)[-1] for key in peft_tensors}
    targets = [name for name in HF_PROJECTIONS if name in found] + sorted(found - set(HF_PROJECTIONS))
    if any(EXPERT_SLOT in name for name in tensors):
        _note_expert_targets(tensors, lora)
        # PEFT's wrappers of fused expert weights (transformers >= 5) refuse dropout; it acts in training only
        lora = dataclasses.replace(lora, dropout=0.0)
    os.makedirs(path, exist_ok=True)
    save_safetensors(peft_tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config_dict(lora, targets, base_model_name_or_path), f, indent=1)


def save_peft_adapter(
    chunks: list[torch.nn.Module], path: str, lora: LoRAConfig, base_model_name_or_path: Optional[str] = None
) -> None:
    """Write the adapters of a (tensor-, expert- and pipeline-parallel) model as one PEFT directory.
    Collective over the tensor-, expert- and pipeline-parallel groups; the first rank of the model writes."""
    tensors = lora_full_tensors(chunks)
    for size, group in (
        (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_group()),
        (ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_group()),
    ):
        if size > 1:  # each expert-parallel rank holds its experts, each stage its layers
            held: list[Optional[dict]] = [None] * size
            dist.all_gather_object(held, tensors, group=group)
            tensors = {name: t for part in held for name, t in part.items()}
    first = (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
        and ps.get_pipeline_model_parallel_rank() == 0
    )
    if first:
        write_peft_adapter(tensors, chunks[0].config, lora, path, base_model_name_or_path)


# -- reading ----------------------------------------------------------------------------------------


def read_peft_config(path: str, hf_names: Optional[Mapping[str, str]] = None) -> LoRAConfig:
    """The LoRA settings of a PEFT adapter directory; settings megacann does not implement are refused.
    ``hf_names`` maps the family's Hugging Face projection names that differ from megacann's targets
    (Mixtral's experts: ``w1`` -> ``gate_proj``…; see :func:`hf_target_names`)."""
    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path}: no {ADAPTER_CONFIG} (expected a PEFT adapter directory)")
    with open(file) as f:
        raw = json.load(f)
    if raw.get("peft_type") != "LORA":
        raise PeftFormatError(f"{file}: peft_type {raw.get('peft_type')!r}; only 'LORA' adapters are supported")
    for key, allowed in _UNSUPPORTED.items():
        if raw.get(key, allowed[0]) not in allowed:
            raise PeftFormatError(f"{file}: {key}={raw[key]!r} is not supported (expected {allowed[0]!r})")
    targets = raw.get("target_modules")
    if isinstance(targets, str) and targets != ALL_PROJECTIONS:
        raise PeftFormatError(f"{file}: target_modules {targets!r} is a pattern; list the projection names instead")
    if hf_names and isinstance(targets, list):
        targets = list(dict.fromkeys(hf_names.get(t, t) for t in targets))
    try:
        return LoRAConfig(
            rank=raw["r"], alpha=raw["lora_alpha"], dropout=raw.get("lora_dropout", 0.0), target_modules=targets
        )
    except KeyError as err:
        raise PeftFormatError(f"{file}: missing {err.args[0]!r}") from None
    except ValueError as err:
        raise PeftFormatError(f"{file}: {err}") from None


def hf_target_names(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, str]:
    """Hugging Face projection names of ``model`` that differ from megacann's part names, mapped to them
    (e.g. Mixtral's ``w1``/``w3``/``w2`` -> ``gate_proj``/``up_proj``/``down_proj``)."""
    names: dict[str, str] = {}
    for layer, module in model.named_modules():
        if adapter_layout(module) is not None:
            for part, hf_module, _ in _matched_parts(layer, cfg, "PEFT"):
                leaf = hf_module.rsplit(".", 1)[-1]
                if leaf != part:
                    names[leaf] = part
    return names


def read_peft_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path}: no {ADAPTER_WEIGHTS}")
    return load_file(file)


def _linear_modules(model: torch.nn.Module, cfg: ModelConfig, others: bool = False) -> set[str]:
    """Hugging Face module names of every projection of ``model`` that can carry a LoRA (``others``: with
    the experts other expert-parallel ranks hold)."""
    parts = _linear_parts(cfg, "PEFT")
    names = [name for name, module in model.named_modules() if adapter_layout(module) is not None]
    names += expert_layers_elsewhere(model) if others else []
    return {hf.removesuffix(".weight") for name in names for hf, _ in parts(f"{name}.weight", cfg)}


def from_peft_tensors(
    model: torch.nn.Module,
    peft_tensors: Mapping[str, torch.Tensor],
    source: str = "adapter",
    cfg: Optional[ModelConfig] = None,
) -> dict[str, torch.Tensor]:
    """The whole tensors of ``model``'s attached adapters, built from PEFT tensors (parts joined by rows).
    Keys of layers this model chunk does not hold (other pipeline stages) are ignored; any other unused
    key, or a missing one, is an error. ``cfg`` defaults to ``model.config``."""
    cfg = cfg if cfg is not None else model.config
    if get_model_spec(cfg.type).hf.lora_b_to_hf is not None:
        raise PeftFormatError(
            f"{source}: reading PEFT adapters of model family {cfg.type!r} is not implemented (its Hugging Face "
            "projections regroup megacann's rows; megacann writes them only)"
        )
    unused = set(peft_tensors)
    out: dict[str, torch.Tensor] = {}
    for layer, adapter in lora_adapters(model):
        parts = [(part, module) for part, module, _ in _matched_parts(layer, cfg, source)]
        modules = [module for part, module in parts if part in adapter.target.selected_parts]
        pieces = {}
        for which in ("lora_A", "lora_B"):
            keys = [_peft_key(module, which) for module in modules]
            missing = [k for k in keys if k not in peft_tensors]
            if missing:
                raise PeftFormatError(f"{source}: missing tensor {missing[0]!r}")
            unused.difference_update(keys)
            pieces[which] = [peft_tensors[k] for k in keys]
        if adapter.target.shared and len(modules) > 1:
            if any(not torch.equal(a, pieces["lora_A"][0]) for a in pieces["lora_A"]):
                names = "/".join(adapter.target.selected_parts)
                raise PeftFormatError(
                    f"{source}: {names} of {layer} have different lora_A matrices, so they cannot share one A on "
                    f"the fused layer; target the parts ({', '.join(adapter.target.selected_parts)}) instead"
                )
            a = pieces["lora_A"][0]
        else:
            a = torch.cat(pieces["lora_A"], dim=0)
        out[f"{layer}{ADAPTER_SLOT}lora_A"] = a
        out[f"{layer}{ADAPTER_SLOT}lora_B"] = torch.cat(pieces["lora_B"], dim=0)
    if unused:
        whole = whole_model_on_meta(get_model_spec(cfg.type), cfg)
        # layers of other pipeline stages, and experts of other expert-parallel ranks
        elsewhere = _linear_modules(whole, cfg, others=True) - _linear_modules(model, cfg)
        stray = sorted(k for k in unused if k[len(PEFT_PREFIX) :].rsplit(".", 2)[0] not in elsewhere)
        if stray:
            raise PeftFormatError(f"{source}: tensors {stray[:3]} match no LoRA of the model")
    return out


@torch.no_grad()
def load_peft_adapter(
    model: torch.nn.Module, path: str, freeze_base: bool = True, cfg: Optional[ModelConfig] = None
) -> LoRAConfig:
    """Attach the LoRA described by a PEFT directory to ``model`` (this rank's chunk; strict target
    matching is left to the caller for pipeline stages) and load its weights into this rank's shards.
    ``cfg`` (the model's settings) defaults to ``model.config``."""
    lora = read_peft_config(path, hf_target_names(model, cfg if cfg is not None else model.config))
    attach_lora(model, lora, freeze_base=freeze_base, strict=False)
    source = os.path.join(path, ADAPTER_WEIGHTS)
    tensors = from_peft_tensors(model, read_peft_tensors(path), source=source, cfg=cfg)
    adapters = dict(lora_adapters(model))
    for name, param in lora_parameters(model):
        full, sharding = tensors[name], get_sharding(param)
        if tuple(full.shape) != sharding.full_shape:
            raise PeftFormatError(
                f"{path}: {name} has shape {list(full.shape)}, the model expects {list(sharding.full_shape)}"
            )
        adapter = adapters[_split_name(name)[0]]
        local = shard_tensor(full.to(torch.float32), sharding, adapter.tp_rank, adapter.tp_size)
        param.copy_(local.to(dtype=param.dtype, device=param.device))
    return lora
