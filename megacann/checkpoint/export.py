"""Consolidated exports on one process, whatever layout (and number of devices) wrote the checkpoint.

- a *consolidated* directory: ``model.safetensors`` (every whole, unpadded weight under its megacann name)
  and ``model_config.json`` (the model settings; usable as a recipe's ``model.config_path``);
- a Hugging Face directory (``config.json`` + ``model.safetensors``) of any model family with a Hugging
  Face adapter (:mod:`megacann.models.hf`), from a checkpoint or a consolidated directory, and back.

The tokenizer the weights were trained with goes along (:mod:`megacann.checkpoint.tokenizer`): into a
consolidated directory's ``tokenizer/``, and into a Hugging Face directory as ``tokenizer.json`` (or
``tokenizer.model``), ``tokenizer_config.json`` and ``generation_config.json``, so that
``AutoTokenizer.from_pretrained`` and ``generate`` work on the export as they are.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp

from megacann.accelerator import PRECISION_DTYPES
from megacann.checkpoint.metadata import (
    CheckpointError,
    check_files,
    model_config_of,
    raise_if_problems,
    read_dcp_metadata,
    read_info,
)
from megacann.checkpoint.pieces import Piece
from megacann.checkpoint.planner import PieceLoadPlanner, TensorPieces
from megacann.checkpoint.sources import (
    CHECKPOINT,
    CONSOLIDATED,
    CONSOLIDATED_CONFIG,
    HUGGINGFACE,
    refuse_adapter_checkpoint,
    resolve_weight_source,
)
from megacann.checkpoint.state import MODEL_PREFIX
from megacann.checkpoint.tokenizer import find_tokenizer
from megacann.config import ModelConfig
from megacann.config.families import model_config_from_dict
from megacann.data.tokenizer import TokenizerError, load_tokenizer
from megacann.data.tokenizer_files import (
    GENERATION_CONFIG_FILE,
    TOKENIZER_DIR,
    generation_config,
    save_tokenizer,
    tokenizer_record,
)
from megacann.models import hf

Log = Callable[[str], None]

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = CONSOLIDATED_CONFIG


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
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(entries, storage_reader=dcp.FileSystemReader(path), planner=PieceLoadPlanner(), no_dist=True)
    tensors = {key[len(MODEL_PREFIX) :]: entry.pieces[0].tensor for key, entry in entries.items()}
    return tensors, model_config_of(info)


def cast_weights(tensors: dict[str, torch.Tensor], dtype: Optional[str]) -> dict[str, torch.Tensor]:
    if dtype is None:
        return tensors
    return {name: t.to(PRECISION_DTYPES[dtype]) for name, t in tensors.items()}


def write_consolidated(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    contiguous = {name: t.contiguous() for name, t in sorted(tensors.items())}
    hf.save_safetensors(contiguous, os.path.join(out, WEIGHTS_FILE), metadata={"format": "pt", "producer": "megacann"})
    with open(os.path.join(out, CONFIG_FILE), "w") as f:
        json.dump(asdict(cfg), f, indent=1)


def read_consolidated(path: str) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    from safetensors.torch import load_file

    weights, config = os.path.join(path, WEIGHTS_FILE), os.path.join(path, CONFIG_FILE)
    for file in (weights, config):
        if not os.path.isfile(file):
            raise CheckpointError(
                f"{path}: not a consolidated megacann directory ({os.path.basename(file)} is missing)"
            )
    with open(config) as f:
        values = json.load(f)
    return load_file(weights), model_config_from_dict(values, config)


def read_weights(source: str) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Whole weights and model config from a checkpoint, an output directory (its latest checkpoint), a
    consolidated directory or a Hugging Face directory. A checkpoint of LoRA adapters is refused (see
    :mod:`megacann.checkpoint.lora_export`)."""
    found = resolve_weight_source(source, "source")
    refuse_adapter_checkpoint(found, "source")
    if found.kind == CHECKPOINT:
        return read_checkpoint_weights(found.path)
    if found.kind == CONSOLIDATED:
        return read_consolidated(found.path)
    spec, cfg = hf.hf_family(found.path)
    names = hf.model_parameter_names(spec, cfg)
    return spec.hf.from_hf(names, hf.SafetensorsReader(found.path), cfg), cfg


def source_tokenizer(source: str, cfg: ModelConfig, log: Log) -> Optional[Any]:
    """The tokenizer the source's weights were trained with (said where it came from), or None (said why)."""
    found = resolve_weight_source(source, "source")
    if found.kind == HUGGINGFACE:
        try:
            tokenizer, where = load_tokenizer(found.path), found.path
        except TokenizerError as err:
            tokenizer, where = None, str(err)
    else:
        tokenizer, where = find_tokenizer(found.path, found.kind == CHECKPOINT, cfg.vocab_size)
    if tokenizer is None:
        log(f"no tokenizer to export: {where}")
        return None
    if cfg.vocab_size is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"the tokenizer from {where} has {tokenizer.vocab_size} tokens, more than the model's vocab_size "
            f"{cfg.vocab_size}: it is not the tokenizer these weights were trained with"
        )
    log(f"tokenizer: {where}")
    return tokenizer


def consolidate(source: str, out: str, dtype: Optional[str] = None, log: Log = print) -> str:
    """Checkpoint (any layout) -> consolidated directory (with the run's tokenizer in ``tokenizer/``)."""
    tensors, cfg = read_weights(source)
    write_consolidated_export(cast_weights(tensors, dtype), cfg, out, source_tokenizer(source, cfg, log))
    return out


def write_consolidated_export(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out: str, tokenizer: Any) -> None:
    """A consolidated directory of ``tensors``, with ``tokenizer`` (if any) in ``tokenizer/``."""
    write_consolidated(tensors, cfg, out)
    if tokenizer is not None:
        save_tokenizer(tokenizer, os.path.join(out, TOKENIZER_DIR))


def export_hf(source: str, out: str, dtype: Optional[str] = None, log: Log = print) -> str:
    """Checkpoint or consolidated directory -> Hugging Face directory (the family's adapter names the
    weights), with the run's tokenizer and a generation config naming its special tokens."""
    tensors, cfg = read_weights(source)
    write_hf_export(cast_weights(tensors, dtype), cfg, out, source_tokenizer(source, cfg, log))
    return out


def write_hf_export(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out: str, tokenizer: Any) -> None:
    """A Hugging Face directory of ``tensors`` (the family's adapter names them) with ``tokenizer`` (if any)
    and a generation config naming its special tokens."""
    token_ids = generation_config(tokenizer_record(tokenizer)) if tokenizer is not None else {}
    hf.save_hf_tensors(tensors, cfg, out, extra_config=token_ids)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out, model_max_length=cfg.max_position_embeddings)
        with open(os.path.join(out, GENERATION_CONFIG_FILE), "w") as f:
            json.dump(token_ids, f, indent=1)


def import_hf(hf_dir: str, out: str, dtype: Optional[str] = None, log: Log = print) -> str:
    """Hugging Face directory -> consolidated directory (megacann names, e.g. fused qkv / gate-up), with the
    directory's tokenizer (if it has one) in ``tokenizer/``."""
    spec, cfg = hf.hf_family(hf_dir)
    names = hf.model_parameter_names(spec, cfg)
    tensors = spec.hf.from_hf(names, hf.SafetensorsReader(hf_dir), cfg)
    write_consolidated(cast_weights(tensors, dtype), cfg, out)
    try:
        tokenizer = load_tokenizer(hf_dir)
    except TokenizerError as err:
        log(f"no tokenizer copied: {err}")
    else:
        save_tokenizer(tokenizer, os.path.join(out, TOKENIZER_DIR))
    return out
