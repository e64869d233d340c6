"""What a checkpoint says about itself, and checks of its files against that, before anything is read.

Two descriptions live in a checkpoint directory: DCP's ``.metadata`` (every tensor's whole shape and
dtype, the box of every stored chunk, and the file, offset and length that hold it) and megacann's
``megacann.json`` (format, step, consumed samples, the parallel layout that wrote it, the model
config). Together they let any layout, or one process with no devices, read the checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megacann import parallel_state as ps
from megacann.checkpoint.planner import TensorPieces
from megacann.config import MegacannConfig, ModelConfig
from megacann.config.families import model_config_from_dict
from megacann.errors import MegacannError

FORMAT = "megacann-dcp"
FORMAT_VERSION = 3  # 3: progress holds step, consumed_samples and the loop's counters
INFO_FILE = "megacann.json"
RECIPE_FILE = "config.yaml"
DCP_METADATA = ".metadata"
MAX_LISTED = 8


class CheckpointError(MegacannError, RuntimeError):
    """A checkpoint that cannot be used: missing or truncated files, missing tensors, other shapes."""


def layout_of(cfg: MegacannConfig) -> dict[str, Any]:
    d = cfg.distributed
    return {
        "world_size": d.world_size,
        "tensor_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_size": d.virtual_pipeline_size,
        "data_parallel_size": ps.get_data_parallel_world_size(),
        "context_parallel_size": d.context_parallel_size,
        "expert_parallel_size": d.expert_parallel_size,
        "zero_stage": d.zero_stage,
    }


def describe_layout(layout: dict[str, Any]) -> str:
    text = f"tp{layout['tensor_parallel_size']} pp{layout['pipeline_parallel_size']} dp{layout['data_parallel_size']}"
    if layout.get("context_parallel_size", 1) > 1:
        text += f" cp{layout['context_parallel_size']}"
    if (layout.get("expert_parallel_size") or 1) > 1:
        text += f" ep{layout['expert_parallel_size']}"
    if layout.get("virtual_pipeline_size"):
        text += f" vpp{layout['virtual_pipeline_size']}"
    if layout.get("zero_stage"):
        text += f" zero{layout['zero_stage']}"
    return text


def checkpoint_info(
    cfg: MegacannConfig, step: int, consumed_samples: int, base: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    info = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "consumed_samples": consumed_samples,
        "layout": layout_of(cfg),
        "model": asdict(cfg.model),
        "torch_version": torch.__version__,
    }
    if cfg.experiment.imports:  # the modules that register the model's family (experiment.imports)
        info["imports"] = list(cfg.experiment.imports)
    if base is not None:  # only the trainable parameters are stored; the frozen ones come from the base
        info["base"] = base
        info["lora"] = {
            "rank": cfg.lora_rank,
            "alpha": cfg.lora_alpha,
            "dropout": cfg.lora_dropout,
            "target_modules": cfg.lora_target_modules,
        }
    return info


BASE_IDENTITY_KEYS = ("kind", "fingerprint", "step", "seed")  # what must agree (a moved base keeps them)


def base_problems(path: str, saved: Optional[dict[str, Any]], expected: Optional[dict[str, Any]]) -> list[str]:
    """Why checkpoint ``path`` (its base reference ``saved``) cannot load into a run whose frozen base is
    ``expected`` (None: a run that saves every parameter)."""
    if saved is None and expected is None:
        return []
    if saved is None:
        return [
            f"{path} is a full checkpoint, but this run trains LoRA adapters on a frozen base "
            "(to fine-tune from it, set model.init_from to it in a new output_dir)"
        ]
    if expected is None:
        return [
            f"{path} holds LoRA adapters on the base {saved.get('path')}; this run trains every parameter "
            "(set lora: true and model.init_from to that base, or merge: megacann-convert merge-lora)"
        ]
    differ = [k for k in BASE_IDENTITY_KEYS if saved.get(k) != expected.get(k)]
    if differ:
        detail = ", ".join(f"{k} {saved.get(k)!r} there, {expected.get(k)!r} now" for k in differ)
        return [f"{path} was trained on another base than this run's ({saved.get('path')}: {detail})"]
    return []


def read_info(path: str) -> dict[str, Any]:
    """``megacann.json`` of a checkpoint directory; errors say what is wrong with the directory."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    file = os.path.join(path, INFO_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: not a megacann checkpoint ({INFO_FILE} is missing)")
    try:
        with open(file) as f:
            info = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{file}: unreadable: {err}") from None
    if info.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {info.get('format')!r}, expected {FORMAT!r}")
    if info.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: format version {info['format_version']} is newer than this megacann reads ({FORMAT_VERSION})"
        )
    return info


def model_config_of(info: dict[str, Any]) -> ModelConfig:
    return model_config_from_dict(info["model"], "checkpoint info", info.get("imports", ()))


def read_dcp_metadata(path: str) -> Metadata:
    file = os.path.join(path, DCP_METADATA)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: {DCP_METADATA} is missing (the checkpoint was not written completely)")
    try:
        with open(file, "rb") as f:
            return pickle.load(f)
    except Exception as err:
        raise CheckpointError(f"{file}: unreadable ({type(err).__name__}: {err})") from None


def _listed(items: list[str]) -> str:
    more = f"\n  ... and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    return "".join(f"\n  - {item}" for item in items[:MAX_LISTED]) + more


def check_files(path: str, metadata: Metadata, keys: Optional[Iterable[str]] = None) -> list[str]:
    """Problems with the data files that hold ``keys`` (all by default): missing or too short."""
    wanted = None if keys is None else set(keys)
    sizes: dict[str, Optional[int]] = {}
    problems: dict[str, str] = {}
    for index, where in metadata.storage_data.items():
        if wanted is not None and index.fqn not in wanted:
            continue
        file = where.relative_path
        if file not in sizes:
            full = os.path.join(path, file)
            sizes[file] = os.path.getsize(full) if os.path.isfile(full) else None
        size, needed = sizes[file], where.offset + where.length
        if file in problems:
            continue
        if size is None:
            problems[file] = f"file {file} is missing (it holds tensor '{index.fqn}')"
        elif size < needed:
            problems[file] = (
                f"file {file} is truncated: tensor '{index.fqn}' needs bytes up to {needed}, the file has {size}"
            )
    return list(problems.values())


def check_entries(metadata: Metadata, entries: dict[str, TensorPieces]) -> list[str]:
    """Tensors this rank needs that the checkpoint lacks or holds with another shape."""
    problems = []
    stored = metadata.state_dict_metadata
    for key, entry in entries.items():
        found = stored.get(key)
        if found is None:
            problems.append(f"tensor '{key}' is missing (the model expects shape {list(entry.shape)})")
        elif not isinstance(found, TensorStorageMetadata):
            problems.append(f"'{key}' is not a tensor in the checkpoint")
        elif tuple(found.size) != tuple(entry.shape):
            problems.append(
                f"tensor '{key}' has shape {list(found.size)} in the checkpoint, the model expects {list(entry.shape)}"
            )
    return problems


def raise_if_problems(problems: list[str], what: str) -> None:
    if problems:
        unique = list(dict.fromkeys(problems))
        raise CheckpointError(f"{what}: {len(unique)} problem(s):{_listed(unique)}")
