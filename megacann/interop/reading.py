"""Reading weights from any directory :func:`~megacann.interop.sources.resolve_weight_source` knows.

- :func:`read_weights` gives every whole tensor (megacann names) and the model config on one process
  (the converter, exports);
- :func:`load_source_weights` copies a source's weights into this rank's model chunks (each rank reads
  only what its shards need; no collective): ``model.init_from``.

A checkpoint of LoRA adapters is no full model and is refused (see :mod:`megacann.interop.lora_export`).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp

from megacann.checkpoint.metadata import (
    CheckpointError,
    check_entries,
    check_files,
    model_config_of,
    raise_if_problems,
    read_dcp_metadata,
    read_info,
)
from megacann.checkpoint.pieces import Piece
from megacann.checkpoint.planner import PieceLoadPlanner, TensorPieces
from megacann.checkpoint.state import MODEL_PREFIX, CheckpointParts, model_entries, storage_name
from megacann.config import ModelConfig
from megacann.config.families import model_config_from_dict
from megacann.interop.full_state import checkpoint_buffers, load_full_tensor_, model_parameter_names
from megacann.interop.hf import SafetensorsReader, hf_family, hf_weights_reader
from megacann.interop.names import CONSOLIDATED_CONFIG, WEIGHTS_FILE
from megacann.interop.quantized import DequantizingReader
from megacann.interop.sources import (
    CHECKPOINT,
    CONSOLIDATED,
    HUGGINGFACE,
    WeightSource,
    refuse_adapter_checkpoint,
    resolve_weight_source,
)
from megacann.models.spec import ModelSpec, get_model_spec


def _dcp_load(entries: dict, path: str) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(entries, storage_reader=dcp.FileSystemReader(path), planner=PieceLoadPlanner(), no_dist=True)


def read_checkpoint_weights(path: str) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Every whole model weight of a checkpoint (megacann names) and its model config, on this process."""
    info = read_info(path)
    metadata = read_dcp_metadata(path)
    keys = [k for k in metadata.state_dict_metadata if k.startswith(MODEL_PREFIX)]
    raise_if_problems(check_files(path, metadata, keys), f"cannot read checkpoint {path}")
    entries = {}
    for key in keys:
        stored = metadata.state_dict_metadata[key]
        whole = torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
        entries[key] = TensorPieces(
            tuple(whole.shape), whole.dtype, [Piece((0,) * whole.dim(), tuple(whole.shape), whole)]
        )
    _dcp_load(entries, path)
    tensors = {key[len(MODEL_PREFIX) :]: entry.pieces[0].tensor for key, entry in entries.items()}
    return tensors, model_config_of(info)


def read_consolidated(path: str) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """The weights and model config of a consolidated directory."""
    from safetensors.torch import load_file

    weights, config = os.path.join(path, WEIGHTS_FILE), os.path.join(path, CONSOLIDATED_CONFIG)
    for file in (weights, config):
        if not os.path.isfile(file):
            raise CheckpointError(
                f"{path}: not a consolidated megacann directory ({os.path.basename(file)} is missing)"
            )
    with open(config) as f:
        values = json.load(f)
    return load_file(weights), model_config_from_dict(values, config, values.get("imports", ()))


def read_hf_weights(path: str, fp8_dtype: Optional[torch.dtype] = None) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """The weights (megacann names, e.g. fused qkv / gate-up) and model config of a Hugging Face directory;
    block-scaled fp8 weights dequantised into ``fp8_dtype`` (default: the dtype config.json names)."""
    spec, cfg, raw = hf_family(path)
    return spec.hf.from_hf(model_parameter_names(spec, cfg), hf_weights_reader(path, fp8_dtype, raw), cfg), cfg


def read_weights(source: str, fp8_dtype: Optional[torch.dtype] = None) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Whole weights and model config from a checkpoint, an output directory (its latest checkpoint), a
    consolidated directory or a Hugging Face directory (fp8 weights dequantised into ``fp8_dtype``, see
    :func:`read_hf_weights`). A checkpoint of LoRA adapters is refused."""
    found = resolve_weight_source(source, "source")
    refuse_adapter_checkpoint(found, "source")
    if found.kind == CHECKPOINT:
        return read_checkpoint_weights(found.path)
    if found.kind == CONSOLIDATED:
        return read_consolidated(found.path)
    return read_hf_weights(found.path, fp8_dtype)


def _hf_source(source: WeightSource, model_cfg: ModelConfig) -> tuple[ModelSpec, DequantizingReader]:
    """The family of a Hugging Face ``source`` (refused unless it is ``model.type``) and its tensors, fp8
    weights dequantised in fp32 (cast once to the chunks' dtype as every tensor is)."""
    spec, _, raw = hf_family(source.path)
    if spec.name != model_cfg.type:
        raise CheckpointError(
            f"model.init_from: {source.path} is a Hugging Face model of family {spec.name!r}, but model.type is "
            f"{model_cfg.type!r}"
        )
    return spec, hf_weights_reader(source.path, torch.float32, raw)


@torch.no_grad()
def load_source_weights(chunks: Sequence[torch.nn.Module], source: WeightSource, model_cfg: ModelConfig) -> None:
    """Copy the source's weights into every parameter of this rank's ``chunks`` (this rank's shards only;
    cast to the chunks' dtype). Errors list every missing tensor and shape mismatch."""
    what = f"model.init_from {source.path}"
    refuse_adapter_checkpoint(source, "model.init_from")
    if source.kind == CHECKPOINT:
        entries = model_entries(CheckpointParts(list(chunks)))
        metadata = read_dcp_metadata(source.path)
        problems = check_entries(metadata, entries) + check_files(source.path, metadata, entries)
        raise_if_problems(problems, f"cannot load {what}")
        _dcp_load(entries, source.path)
        return
    spec, reader = (
        _hf_source(source, model_cfg) if source.kind == HUGGINGFACE else (None, SafetensorsReader(source.path))
    )

    def whole(name: str) -> torch.Tensor:
        try:
            return spec.hf.from_hf([name], reader, model_cfg)[name] if spec else reader(name)
        except KeyError as err:
            raise CheckpointError(f"cannot load {what}: {err.args[0]}") from None

    for chunk in chunks:
        for name, param in chunk.named_parameters():
            stored = storage_name(name, param)  # a pipeline stage's tied copy is stored as what it copies
            load_full_tensor_(param, whole(stored), stored, what)
        for name, buffer in checkpoint_buffers(get_model_spec(model_cfg.type).hf, chunk):  # hash tables, say
            load_full_tensor_(buffer, whole(name), name, what)
