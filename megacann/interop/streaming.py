"""Hugging Face-named weights of a live model streamed in buckets: the update a serving engine (vLLM,
SGLang, vllm-ascend) takes between reinforcement-learning steps, from any training layout.

:func:`stream_hf_weights` walks the model one *unit* at a time (a transformer layer, or the tensors outside
the layers), in an order every rank agrees on. For each tensor the ranks of its tensor-parallel group join
its shards (:func:`~megacann.interop.full_state.gather_full_tensor`); the rank that holds the whole tensor
(the first tensor-, data- and, for experts, expert-data-parallel rank of its stage) sends it to global
rank 0. When a unit is whole, rank 0 names it as the family's Hugging Face adapter does (fused projections
split, experts of every expert-parallel rank together) and adds it to the bucket; a bucket is handed out
once it would grow past ``bucket_mb``. So rank 0 holds at most one bucket and one unit beyond the model
(less: a tensor it holds whole on the CPU is not copied), and the tensors are bit for bit those of ``megacann-convert to-hf`` of a checkpoint of the same weights.
Under ZeRO-3 each rank gathers the units of its shards one at a time, in the walk's order, as a forward
does (:func:`~megacann.layers.gathered_weights.parameters_gathered`), and frees each after its turn: one
unit whole at a time, copied into the bucket on rank 0.

Every rank iterates (the transfers are collective); only rank 0's iterator yields buckets::

    for bucket in stream_hf_weights(model_chunks, cfg.model, bucket_mb=512):
        engine.load_weights(bucket)        # rank 0: a list of (Hugging Face name, tensor)

:func:`load_into_module` is a receiver for a module whose parameters carry Hugging Face names (for example
a transformers model, or an engine's model behind its ``load_weights``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.checkpoint.state import is_expert_buffer, persistent_buffers, storage_name
from megacann.config import ModelConfig
from megacann.interop.full_state import gather_full_tensor, without_padding
from megacann.interop.hf import hf_adapter
from megacann.interop.peft import ADAPTER_SLOT
from megacann.layers.gathered_weights import parameters_gathered
from megacann.layers.sharding import get_sharding

Bucket = list[tuple[str, torch.Tensor]]
_UNIT = re.compile(r"^((?:[A-Za-z_]+\.)*?[A-Za-z_]*layers\.\d+)\.")


@dataclass(frozen=True)
class _Entry:
    """One tensor of the model as every rank knows it: its name, whole shape and dtype, and who sends it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sender: int  # the global rank that holds it whole and sends it to rank 0


def unit_of(name: str) -> str:
    """The unit a tensor travels in: its transformer layer (``layers.3``, ``mtp_layers.0``), or ``""``."""
    match = _UNIT.match(name)
    return match[1] if match else ""


def _local_tensors(chunks: Sequence[torch.nn.Module]) -> dict[str, tuple[torch.Tensor, bool, bool]]:
    """Name -> (tensor, whether this rank gathers it with its tensor-parallel group, whether it sends it)."""
    dense_copy = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    expert_copy = ps.get_expert_data_parallel_rank(with_context_parallel=True) == 0
    tp_first = ps.get_tensor_model_parallel_rank() == 0
    found: dict[str, tuple[torch.Tensor, bool, bool]] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if ADAPTER_SLOT in name:
                raise ValueError(
                    f"stream_hf_weights: {name!r} is a LoRA adapter; stream a model without adapters (merge them "
                    "first: megacann-convert merge-lora) or hand the adapters to the engine as a PEFT directory"
                )
            copy = expert_copy if get_sharding(param).expert else dense_copy
            found.setdefault(storage_name(name, param), (param, copy, copy and tp_first))
        for name, buffer in persistent_buffers(chunk):
            copy = expert_copy if is_expert_buffer(name) else dense_copy
            found.setdefault(name, (buffer, False, copy and tp_first))
    return found


def _plan(local: dict[str, tuple[torch.Tensor, bool, bool]]) -> list[_Entry]:
    """Every tensor of the model in the order all ranks walk it (by unit, then name), with its sender."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = []
    for name, (tensor, _, sends) in local.items():
        if sends:
            shape = get_sharding(tensor).logical_shape if isinstance(tensor, torch.nn.Parameter) else tensor.shape
            mine.append(_Entry(name, tuple(shape), tensor.dtype, rank))
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Optional[list[_Entry]]] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    entries: dict[str, _Entry] = {}
    for part in everyone:
        for entry in part or []:
            entries.setdefault(entry.name, entry)  # a tied copy on a later stage is sent once
    return sorted(entries.values(), key=lambda e: (unit_of(e.name), e.name))


def _split_over_tp(tensor: torch.Tensor) -> bool:
    return (
        isinstance(tensor, torch.nn.Parameter)
        and get_sharding(tensor).tp_dim is not None
        and ps.get_tensor_model_parallel_world_size() > 1
    )


def _whole_on_first_rank(
    entry: _Entry, local: dict[str, tuple[torch.Tensor, bool, bool]], copy: bool
) -> Optional[torch.Tensor]:
    """The whole tensor of ``entry`` on global rank 0 (None elsewhere); collective over the ranks that hold it.
    ``copy``: never hand out the live tensor (a ZeRO-3 unit's gathered storage is released after it)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    whole = None
    if entry.name in local:
        tensor, gathers, _ = local[entry.name]
        if gathers and _split_over_tp(tensor):
            whole = gather_full_tensor(tensor)  # every rank of the sender's tensor-parallel group joins
        elif rank == entry.sender:
            if isinstance(tensor, torch.nn.Parameter):
                tensor = without_padding(tensor)  # a padded vocabulary's rows dropped, as to-hf does
            whole = tensor.detach().to("cpu")  # the live tensor itself on a CPU: no copy (see the docstring)
            if copy and whole.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
                whole = whole.clone()
    if entry.sender == 0:
        return whole if rank == 0 else None
    if rank == entry.sender:
        dist.send(whole.contiguous(), dst=0)
    elif rank == 0:
        whole = torch.empty(entry.shape, dtype=entry.dtype)
        dist.recv(whole, src=entry.sender)
        return whole
    return None


def stream_hf_weights(
    chunks: Sequence[torch.nn.Module], cfg: ModelConfig, bucket_mb: float = 512.0
) -> Iterator[Bucket]:
    """The model's weights under their Hugging Face names, in buckets of about ``bucket_mb`` MiB (a unit
    larger than that is a bucket of its own), yielded on global rank 0. Collective over the world: every
    rank must exhaust the iterator. ``chunks``: this rank's model chunks at any layout (TP, PP, EP, DP,
    ZeRO-3: each unit gathered for its turn alone and freed after).
    A tensor rank 0 holds whole on the CPU is handed out as the live tensor, not a copy: the receiver copies
    each bucket before the model trains on (as an engine's weight loading does)."""
    if bucket_mb <= 0:
        raise ValueError(f"stream_hf_weights: bucket_mb must be > 0, got {bucket_mb}")
    adapter = hf_adapter(cfg)
    limit = bucket_mb * 2**20
    local = _local_tensors(chunks)
    bucket: Bucket = []
    held = 0
    for entries in _units(_plan(local)):
        # under ZeRO-3 this unit's weights are gathered for it alone (as a forward does), freed after it
        with parameters_gathered(chunks, [local[e.name][0] for e in entries if e.name in local]) as sharded:
            unit = {}
            for entry in entries:
                whole = _whole_on_first_rank(entry, local, copy=sharded)
                if whole is not None:
                    unit[entry.name] = whole
            named = sorted(adapter.to_hf(unit, cfg).items()) if unit else []
        if not named:
            continue
        size = sum(t.nbytes for _, t in named)
        if bucket and held + size > limit:
            yield bucket
            bucket, held = [], 0
        bucket.extend(named)
        held += size
    if bucket:
        yield bucket


def _units(plan: list[_Entry]) -> list[list[_Entry]]:
    """The plan's entries by unit (the plan is sorted by unit)."""
    grouped: list[list[_Entry]] = []
    for index, entry in enumerate(plan):
        if index == 0 or unit_of(entry.name) != unit_of(plan[index - 1].name):
            grouped.append([])
        grouped[-1].append(entry)
    return grouped


@torch.no_grad()
def load_into_module(module: torch.nn.Module, bucket: Bucket, strict_names: bool = True) -> list[str]:
    """A receiver: copy a bucket into ``module``'s parameters and buffers of the same (Hugging Face) names,
    cast to their dtype; returns the names it set. A name the module lacks is an error unless
    ``strict_names`` is False (then it is skipped, e.g. an engine that ties the head to the embedding)."""
    targets = dict(module.named_parameters())
    targets.update(module.named_buffers())
    loaded = []
    for name, tensor in bucket:
        target = targets.get(name)
        if target is None:
            if strict_names:
                raise KeyError(f"load_into_module: the receiving module has no tensor named {name!r}")
            continue
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"load_into_module: {name!r} has shape {list(tensor.shape)}, the module's is {list(target.shape)}"
            )
        target.copy_(tensor)
        loaded.append(name)
    return loaded
