"""LoRA on a whole model: attach adapters to the projections a :class:`LoRAConfig` names, list them,
re-draw them, merge them into the base weights and take them out again.

Every module that can carry an adapter (a column- or row-parallel linear layer, an MoE expert's
projection) is found by :func:`megacann.layers.lora.adapter.adapter_layout`; targets are resolved by
:func:`megacann.layers.lora.targets.resolve_target`, the same rule the PEFT reader and writer use.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Callable

import torch

from megacann.layers.lora.adapter import AdapterLayout, LoRAAdapter, adapter_layout, is_lora_parameter
from megacann.layers.lora.targets import FUSED_PROJECTIONS, PROJECTION_NAMES, LoRAConfig, resolve_target
from megacann.layers.sharding import INIT_ATTR, init_sharded_


def _adapter_sites(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, AdapterLayout]]:
    """``(name, module, layout)`` of every module of ``model`` that can carry a LoRA."""
    for name, module in model.named_modules():
        layout = adapter_layout(module)
        if layout is not None:
            yield name, module, layout


def _adapted(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, LoRAAdapter]]:
    for name, module in model.named_modules():
        adapter = getattr(module, "adapter", None)
        if isinstance(adapter, LoRAAdapter):
            yield name, module, adapter


def attach_lora(model: torch.nn.Module, config: LoRAConfig, freeze_base: bool = True, strict: bool = True) -> list[str]:
    """Install a :class:`LoRAAdapter` on every projection of ``model`` that ``config.target_modules`` names
    (parallel linear layers and MoE experts' projections) and return the adapted layers' names.
    ``freeze_base`` sets ``requires_grad=False`` on every other parameter. ``strict``: a target that
    matches no layer is an error (pass False for a pipeline stage that may hold no such layer, and check
    across stages)."""
    targets = config.target_modules
    used: set[str] = set()
    plans = []  # checked in full before any layer changes
    sites = list(_adapter_sites(model))
    for name, module, layout in sites:
        leaf = name.rsplit(".", 1)[-1]
        target = resolve_target(leaf, len(layout.blocks), targets)
        if target is None:
            continue
        if module.adapter is not None:
            raise ValueError(f"{name} already has an adapter ({type(module.adapter).__name__})")
        used.update(
            t for t in targets if t == leaf or t in target.selected_parts or leaf in FUSED_PROJECTIONS.get(t, ())
        )
        plans.append((name, module, layout, target))
    missing = [t for t in targets if t not in used]
    if strict and missing:
        have = sorted({n.rsplit(".", 1)[-1] for n, _, _ in sites} & set(PROJECTION_NAMES))
        raise ValueError(f"LoRA target_modules {missing} match no layer of the model; its projections are {have}")
    for _, module, layout, target in plans:
        module.adapter = LoRAAdapter(layout, target, config.rank, config.alpha, config.dropout)
    if freeze_base:
        for param in model.parameters():
            if not is_lora_parameter(param):
                param.requires_grad_(False)
    return [name for name, _, _, _ in plans]


def lora_adapters(model: torch.nn.Module) -> Iterator[tuple[str, LoRAAdapter]]:
    """``(name of the adapted layer, its adapter)`` for every LoRA in ``model``."""
    for name, _, adapter in _adapted(model):
        yield name, adapter


def lora_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(full name, parameter)`` of every adapter parameter (this rank's shards)."""
    for name, param in model.named_parameters():
        if is_lora_parameter(param):
            yield name, param


@torch.no_grad()
def init_adapters_(model: torch.nn.Module, seed_for_name: Callable[[str], int]) -> None:
    """Re-draw every adapter parameter from a seed given by its full name (e.g. ``functools.partial(
    megacann.layers.parameter_seed, seed)``), leaving the base weights alone: for adapters put on a
    loaded base model. The result is the same under every TP layout."""
    for layer_name, adapter in lora_adapters(model):
        for name, param in adapter.named_parameters():
            full_name = f"{layer_name}.adapter.{name}"
            init_sharded_(param, getattr(param, INIT_ATTR), adapter.tp_rank, adapter.tp_size, seed_for_name(full_name))


@torch.no_grad()
@contextmanager
def adapters_disabled(models: Iterable[torch.nn.Module]) -> Iterator[int]:
    """Inside the block every LoRA adapter of ``models`` is off: the models compute their frozen base
    exactly (no second copy of it), e.g. as a DPO reference policy. Yields how many adapters are off."""
    adapters = [a for model in models for _, a in lora_adapters(model)]
    previous = [a.disabled for a in adapters]
    for adapter in adapters:
        adapter.disabled = True
    try:
        yield len(adapters)
    finally:
        for adapter, was in zip(adapters, previous):
            adapter.disabled = was


def merge_lora(model: torch.nn.Module) -> int:
    """Add ``scaling * B A`` into every adapted layer's weight (this rank's slice; no communication) and
    switch the adapters off. Returns the number of layers merged. Keep a merged model for inference or
    export: its adapters no longer act, and :func:`unmerge_lora` undoes the merge (up to rounding)."""
    count = 0
    for _, layer, adapter in _adapted(model):
        if not adapter.merged:
            layer.weight.add_(adapter.delta_weight().to(layer.weight.dtype))
            adapter.merged = True
            count += 1
    return count


@torch.no_grad()
def unmerge_lora(model: torch.nn.Module) -> int:
    """Subtract merged adapters from their layers' weights and switch them back on."""
    count = 0
    for _, layer, adapter in _adapted(model):
        if adapter.merged:
            layer.weight.sub_(adapter.delta_weight().to(layer.weight.dtype))
            adapter.merged = False
            count += 1
    return count


def unload_lora(model: torch.nn.Module, merge: bool = True) -> int:
    """Take every LoRA out of ``model`` (merged into the base weights first when ``merge``), leaving a plain
    model with the base's parameter names, e.g. to export it. Returns the number of adapters removed."""
    if merge:
        merge_lora(model)
    layers = [layer for _, layer, _ in _adapted(model)]
    for layer in layers:
        layer.adapter = None
    return len(layers)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` numbers of elements held by this rank."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
