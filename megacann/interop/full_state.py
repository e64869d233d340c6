"""Whole (unsharded, unpadded) tensors of a model, gathered from or scattered to tensor-parallel ranks,
and a family's whole model on the meta device (its names and shapes, for nothing).

Used wherever weights leave or enter the parallel layout: Hugging Face import/export, consolidated
exports, tests. Names are the model's own (global layer indices), so a layout never shows in them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.checkpoint.state import persistent_buffers
from megacann.config import MegacannConfig, ModelConfig
from megacann.layers.sharding import ParamSharding, get_sharding, shard_tensor, unshard_tensors
from megacann.models.spec import ChunkPlacement, HFAdapter, ModelSpec


def _strip_padding(full: torch.Tensor, sharding: ParamSharding) -> torch.Tensor:
    if sharding.logical_size is None or sharding.tp_dim is None:
        return full
    return full.narrow(sharding.tp_dim, 0, sharding.logical_size)


def without_padding(param: torch.Tensor) -> torch.Tensor:
    """This rank's ``param`` without the padding its sharding adds (a padded vocabulary's rows): a view."""
    return _strip_padding(param.detach(), get_sharding(param))


def _pad(tensor: torch.Tensor, sharding: ParamSharding) -> torch.Tensor:
    if sharding.logical_size is None or sharding.tp_dim is None:
        return tensor
    missing = sharding.full_shape[sharding.tp_dim] - tensor.shape[sharding.tp_dim]
    if missing <= 0:
        return tensor
    pad_shape = list(tensor.shape)
    pad_shape[sharding.tp_dim] = missing
    return torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=sharding.tp_dim)


def gather_full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter (all TP shards joined, padding dropped): a CPU copy, on every TP rank."""
    sharding = get_sharding(param)
    local = param.detach()
    group = ps.get_tensor_model_parallel_group()
    size = ps.get_tensor_model_parallel_world_size()
    if sharding.tp_dim is None or size == 1:
        full = local
    else:
        shards = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(shards, local.contiguous(), group=group)
        full = unshard_tensors(shards, sharding)
    return _strip_padding(full, sharding).to("cpu", copy=True)  # never an alias of the live tensor


def full_state_dict(modules: Iterable[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Name -> whole tensor for every parameter of this rank's chunks (TP gathered; PP stages separate)."""
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, param in module.named_parameters():
            out[name] = gather_full_tensor(param)
    return out


@torch.no_grad()
def load_full_tensor_(param: torch.Tensor, full: torch.Tensor, name: str, source: str = "state") -> None:
    """Copy the whole tensor ``full`` into this rank's shard of ``param`` (padding added, dtype cast, no
    copy of the whole tensor made on one rank); an error names the tensor and both shapes."""
    sharding = get_sharding(param)
    if tuple(full.shape) != sharding.logical_shape:
        raise ValueError(
            f"{source}: tensor {name!r} has shape {list(full.shape)}, the model expects {list(sharding.logical_shape)}"
        )
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    if sharding.tp_dim is None or tp_size == 1:  # the whole tensor: copied (and cast) in place, padding zeroed
        if tuple(full.shape) != tuple(param.shape):
            param.narrow(
                sharding.tp_dim, full.shape[sharding.tp_dim], param.shape[sharding.tp_dim] - full.shape[sharding.tp_dim]
            ).zero_()
            param = param.narrow(sharding.tp_dim, 0, full.shape[sharding.tp_dim])
        param.copy_(full)
        return
    param.copy_(shard_tensor(_pad(full, sharding), sharding, tp_rank, tp_size))


def load_full_state_dict_(
    modules: Iterable[torch.nn.Module], tensors: Mapping[str, torch.Tensor], source: str = "state"
) -> None:
    """Copy whole tensors into this rank's shards. Every parameter must be present with its whole shape;
    errors name the tensor and both shapes."""
    for module in modules:
        for name, param in module.named_parameters():
            if name not in tensors:
                raise KeyError(
                    f"{source}: missing tensor {name!r} (expected shape {list(get_sharding(param).logical_shape)})"
                )
            load_full_tensor_(param, tensors[name], name, source)


def whole_model_on_meta(spec: ModelSpec, model_cfg: ModelConfig) -> torch.nn.Module:
    """A family's whole model on the meta device (no memory, no init cost): for its names and shapes.
    Fills the family's defaults into ``model_cfg``."""
    cfg = MegacannConfig(model=model_cfg)
    spec.fill_defaults(model_cfg)  # not the family's recipe checks: the rest of this recipe is a default
    with torch.device("meta"):
        return spec.build(cfg, ChunkPlacement(tuple(range(model_cfg.num_layers))), "meta")


def model_parameter_names(spec: ModelSpec, model_cfg: ModelConfig) -> list[str]:
    """The names of a family's whole model that its Hugging Face checkpoint holds: every parameter and
    the buffers the adapter stores (:func:`checkpoint_buffers`)."""
    model = whole_model_on_meta(spec, model_cfg)
    return [name for name, _ in model.named_parameters()] + [name for name, _ in checkpoint_buffers(spec.hf, model)]


def checkpoint_buffers(adapter: Optional[HFAdapter], module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The persistent buffers of ``module`` that its family's Hugging Face checkpoint (``adapter``) stores
    beside the weights (``HFAdapter.checkpoint_buffers``; none for most families)."""
    stored = adapter.checkpoint_buffers if adapter is not None else None
    if stored is None:
        return []
    return [(name, buffer) for name, buffer in persistent_buffers(module) if stored(name)]


@torch.no_grad()
def load_checkpoint_buffers_(
    adapter: Optional[HFAdapter], module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], source: str = "state"
) -> None:
    """Copy the buffers the checkpoint stores (:func:`checkpoint_buffers`) from ``tensors`` (whole, by
    megacann name) into ``module``; an error names a missing one."""
    for name, buffer in checkpoint_buffers(adapter, module):
        if name not in tensors:
            raise KeyError(f"{source}: missing tensor {name!r} (expected shape {list(buffer.shape)})")
        load_full_tensor_(buffer, tensors[name], name, source)
