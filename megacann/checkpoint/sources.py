"""Weights to start from or merge onto: a megacann checkpoint (or an output directory: its latest), a
consolidated directory, or a Hugging Face directory of a family with a Hugging Face adapter.

- :func:`resolve_weight_source` says which kind a directory is;
- :func:`load_source_weights` copies its weights into this rank's model chunks (each rank reads only what
  its shards need; no collective);
- ``megacann.checkpoint.export.read_weights`` gives every whole tensor on one process (the converter);
- :func:`source_identity` names it for a LoRA checkpoint's base reference: kind, path, the checkpoint's
  step, and a fingerprint of the weight files (their sizes and sampled bytes: cheap at any size, and
  different for any retrained or other model).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from megacann.checkpoint.files import latest_checkpoint
from megacann.checkpoint.metadata import (
    DCP_METADATA,
    INFO_FILE,
    CheckpointError,
    check_entries,
    check_files,
    raise_if_problems,
    read_dcp_metadata,
    read_info,
)
from megacann.checkpoint.planner import PieceLoadPlanner
from megacann.checkpoint.state import CheckpointParts, model_entries, storage_name
from megacann.config import ModelConfig
from megacann.models import hf
from megacann.models.full_state import load_full_tensor_
from megacann.models.spec import ModelSpec

CHECKPOINT, CONSOLIDATED, HUGGINGFACE = "checkpoint", "consolidated", "huggingface"
CONSOLIDATED_CONFIG = "model_config.json"
_SAMPLE = 1 << 20  # bytes read at the start, middle and end of each weight file for the fingerprint


@dataclass(frozen=True)
class WeightSource:
    """A directory of weights: ``kind`` (checkpoint / consolidated / huggingface) and ``path`` (an output
    directory resolved to its latest complete checkpoint)."""

    kind: str
    path: str


def resolve_weight_source(path: str, what: str = "model.init_from") -> WeightSource:
    """The kind of weights directory ``path`` is; a CheckpointError says what it is not."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(os.path.join(path, INFO_FILE)):
        return WeightSource(CHECKPOINT, path)
    if os.path.isfile(os.path.join(path, CONSOLIDATED_CONFIG)):
        return WeightSource(CONSOLIDATED, path)
    if os.path.isfile(os.path.join(path, hf.CONFIG_FILE)):
        return WeightSource(HUGGINGFACE, path)
    latest = latest_checkpoint(path) if os.path.isdir(path) else None
    if latest is not None:
        return WeightSource(CHECKPOINT, os.path.abspath(latest))
    raise CheckpointError(
        f"{what}: {path} is neither a megacann checkpoint ({INFO_FILE}), an output directory holding a complete "
        f"checkpoint, a consolidated directory ({CONSOLIDATED_CONFIG}) nor a Hugging Face directory "
        f"({hf.CONFIG_FILE})"
    )


def adapter_base(path: str) -> Any:
    """The base reference of a checkpoint that holds only trainable parameters (LoRA), else None."""
    return read_info(path).get("base")


def refuse_adapter_checkpoint(source: WeightSource, what: str) -> None:
    if source.kind == CHECKPOINT and adapter_base(source.path) is not None:
        raise CheckpointError(
            f"{what}: {source.path} holds LoRA adapters only (on the base {adapter_base(source.path)['path']}); "
            "merge them into a full model first: megacann-convert merge-lora SOURCE OUT"
        )


# -- identity -----------------------------------------------------------------------------------------


def weight_files(source: WeightSource) -> list[str]:
    """The files that hold the weights (paths relative to ``source.path``), sorted."""
    if source.kind == CHECKPOINT:
        names = [n for n in os.listdir(source.path) if n.endswith(".distcp") or n == DCP_METADATA]
    else:
        names = [n for n in os.listdir(source.path) if n.endswith(".safetensors")]
    if not names:
        raise CheckpointError(f"{source.path}: no weight files found")
    return sorted(names)


def fingerprint(source: WeightSource) -> str:
    """sha256 over each weight file's name, size and first, middle and last MiB (hex, 16 characters)."""
    h = hashlib.sha256()
    for name in weight_files(source):
        file = os.path.join(source.path, name)
        size = os.path.getsize(file)
        h.update(f"{name}\0{size}\0".encode())
        with open(file, "rb") as f:
            for offset in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                f.seek(offset)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()[:16]


def source_identity(source: WeightSource) -> dict[str, Any]:
    """What a LoRA checkpoint records about its base: kind, path, fingerprint (and a checkpoint's step)."""
    identity: dict[str, Any] = {"kind": source.kind, "path": source.path, "fingerprint": fingerprint(source)}
    if source.kind == CHECKPOINT:
        identity["step"] = read_info(source.path)["step"]
    return identity


# -- reading ------------------------------------------------------------------------------------------


def _check_family(source: WeightSource, model_cfg: ModelConfig) -> ModelSpec:
    spec, _ = hf.hf_family(source.path)
    if spec.name != model_cfg.type:
        raise CheckpointError(
            f"model.init_from: {source.path} is a Hugging Face model of family {spec.name!r}, but model.type is "
            f"{model_cfg.type!r}"
        )
    return spec


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
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(
                entries, storage_reader=dcp.FileSystemReader(source.path), planner=PieceLoadPlanner(), no_dist=True
            )
        return
    reader = hf.SafetensorsReader(source.path)
    spec = _check_family(source, model_cfg) if source.kind == HUGGINGFACE else None
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            stored = storage_name(name, param)  # a pipeline stage's tied copy is stored as what it copies
            try:
                full = spec.hf.from_hf([stored], reader, model_cfg)[stored] if spec else reader(stored)
            except KeyError as err:
                raise CheckpointError(f"cannot load {what}: {err.args[0]}") from None
            load_full_tensor_(param, full, stored, what)
