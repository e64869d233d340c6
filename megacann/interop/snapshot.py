"""A Hugging Face directory written from a live model in the middle of training, at any layout.

Every rank joins its tensor-parallel shards (:func:`~megacann.interop.full_state.gather_full_tensor`),
then one rank per piece of the model (the first tensor- and data-parallel rank of each pipeline stage, and
of each expert-parallel rank for the experts) sends its whole tensors to global rank 0, which therefore
holds the whole model (in CPU memory) for the moment of the write. The tensors are those a checkpoint
stores (a tied copy under the name it copies, persistent buffers included), so the directory equals
``megacann-convert to-hf`` of the checkpoint of the same step. A LoRA run's adapters are merged into its
base, so ``transformers`` loads the directory as it is. ZeRO shards optimizer state only: the weights are
whole on every data-parallel rank.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.checkpoint.state import is_expert_buffer, persistent_buffers, storage_name
from megacann.config import ModelConfig
from megacann.interop.export import write_hf_export
from megacann.interop.full_state import gather_full_tensor
from megacann.interop.lora_export import merge_adapter_tensors
from megacann.interop.peft import ADAPTER_SLOT
from megacann.layers.lora import LoRAConfig
from megacann.layers.sharding import get_sharding


def _held_here(chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The whole tensors this rank sends to rank 0 (empty on the ranks whose copy another rank sends).
    Collective over the tensor-parallel group."""
    tp_first = ps.get_tensor_model_parallel_rank() == 0
    dense = tp_first and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    expert = tp_first and ps.get_expert_data_parallel_rank(with_context_parallel=True) == 0
    held: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            whole = gather_full_tensor(param)  # every tensor-parallel rank takes part
            if expert if get_sharding(param).expert else dense:
                held[storage_name(name, param)] = whole
        for name, buffer in persistent_buffers(chunk):
            if expert if is_expert_buffer(name) else dense:
                held[name] = buffer.detach().to("cpu", copy=True)
    return held


def whole_model_on_first_rank(
    chunks: Sequence[torch.nn.Module], group: Optional[dist.ProcessGroup] = None
) -> Optional[dict[str, torch.Tensor]]:
    """Every whole tensor of the model (megacann names) on global rank 0, None elsewhere. Collective over
    the world: ``group`` (all ranks; e.g. a gloo group, so the transfer stays in host memory) carries it."""
    held = _held_here(chunks)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return held
    parts: Optional[list[Any]] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(held, parts, dst=0, group=group)
    if parts is None:
        return None
    return {name: tensor for part in parts for name, tensor in part.items()}


def merge_lora_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """A LoRA model's whole tensors (base and adapters) as one full model: each adapter merged into its layer."""
    adapters = {name: t for name, t in tensors.items() if ADAPTER_SLOT in name}
    base = {name: t for name, t in tensors.items() if ADAPTER_SLOT not in name}
    return merge_adapter_tensors(base, adapters, copy.deepcopy(cfg), lora)


def save_hf_snapshot(
    chunks: Sequence[torch.nn.Module],
    cfg: ModelConfig,
    path: str,
    tokenizer: Any = None,
    lora: Optional[LoRAConfig] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Write this (parallel) model as the Hugging Face directory ``path`` with ``tokenizer`` (if any); a
    LoRA model (``lora``: its settings) merged. Collective over the world; rank 0 writes ``path.tmp`` and
    renames it, and every rank raises alike if that fails."""
    tensors = whole_model_on_first_rank(chunks, group)
    failure: list[Optional[str]] = [None]
    if tensors is not None:
        try:
            if lora is not None:
                tensors = merge_lora_tensors(tensors, cfg, lora)
            tmp = path + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            write_hf_export(tensors, cfg, tmp, tokenizer)
            shutil.rmtree(path, ignore_errors=True)  # a resumed run writes its step again
            os.replace(tmp, path)
        except Exception as err:  # every rank learns of it below, so none trains on alone
            failure[0] = f"{type(err).__name__}: {err}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(failure, src=0, group=group)
    if failure[0] is not None:
        raise RuntimeError(f"writing the Hugging Face directory {path} failed: {failure[0]}")
