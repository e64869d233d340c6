"""What kind of weights directory is this: the one answer every reader of weights uses.

A directory of weights is one of

- a megacann checkpoint (``checkpoint_<step>/``: ``megacann.json``);
- a consolidated directory (``megacann-convert consolidate``: ``model_config.json`` + ``model.safetensors``);
- a Hugging Face directory of a family with a Hugging Face adapter (``config.json`` + safetensors);
- a run's output directory, which stands for its latest complete checkpoint (``latest``).

:func:`resolve_weight_source` says which, in that order, and :func:`source_identity` names it for a LoRA
checkpoint's base reference: kind, path, the checkpoint's step, and a fingerprint of the weight files
(their sizes and sampled bytes: cheap at any size, and different for any retrained or other model).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

from megacann.checkpoint.files import latest_checkpoint
from megacann.checkpoint.metadata import CheckpointError, read_info
from megacann.interop.names import CONSOLIDATED_CONFIG, DCP_METADATA, HF_CONFIG, INFO_FILE, LATEST_FILE

CHECKPOINT, CONSOLIDATED, HUGGINGFACE = "checkpoint", "consolidated", "huggingface"
_MARKERS = ((INFO_FILE, CHECKPOINT), (CONSOLIDATED_CONFIG, CONSOLIDATED), (HF_CONFIG, HUGGINGFACE))
_SAMPLE = 1 << 20  # bytes read at the start, middle and end of each weight file for the fingerprint


@dataclass(frozen=True)
class WeightSource:
    """A directory of weights: ``kind`` (checkpoint / consolidated / huggingface) and ``path`` (absolute; an
    output directory resolved to its latest complete checkpoint)."""

    kind: str
    path: str


def resolve_weight_source(path: str, what: str = "model.init_from") -> WeightSource:
    """The kind of weights directory ``path`` is; a CheckpointError (prefixed with ``what``) says what it
    is not."""
    path = os.path.abspath(os.path.expanduser(path))
    kinds = (
        f"neither a megacann checkpoint ({INFO_FILE}), an output directory holding a complete checkpoint "
        f"({LATEST_FILE}), a consolidated directory ({CONSOLIDATED_CONFIG}) nor a Hugging Face directory ({HF_CONFIG})"
    )
    if not os.path.isdir(path):
        raise CheckpointError(f"{what}: {path!r} is not a directory, so {kinds}")
    for marker, kind in _MARKERS:
        if os.path.isfile(os.path.join(path, marker)):
            return WeightSource(kind, path)
    latest = latest_checkpoint(path)
    if latest is not None:
        return WeightSource(CHECKPOINT, os.path.abspath(latest))
    raise CheckpointError(f"{what}: {path!r} is {kinds}")


def adapter_base(path: str) -> Any:
    """The base reference of a checkpoint that holds only trainable parameters (LoRA), else None."""
    return read_info(path).get("base")


def refuse_adapter_checkpoint(source: WeightSource, what: str) -> None:
    """A checkpoint of LoRA adapters is no full model: say how to make one."""
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
