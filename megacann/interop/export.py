"""Consolidated exports on one process, whatever layout (and number of devices) wrote the checkpoint.

- a *consolidated* directory: ``model.safetensors`` (every whole, unpadded weight under its megacann name)
  and ``model_config.json`` (the model settings; usable as a recipe's ``model.config_path``);
- a Hugging Face directory (``config.json`` + ``model.safetensors``) of any model family with a Hugging
  Face adapter (:mod:`megacann.interop.hf`), from a checkpoint or a consolidated directory, and back.

The tokenizer the weights were trained with goes along (:mod:`megacann.interop.tokenizer`): into a
consolidated directory's ``tokenizer/``, and into a Hugging Face directory as ``tokenizer.json`` (or
``tokenizer.model``), ``tokenizer_config.json`` and ``generation_config.json``, so that
``AutoTokenizer.from_pretrained`` and ``generate`` work on the export as they are.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch

from megacann.accelerator import PRECISION_DTYPES
from megacann.config import ModelConfig
from megacann.data.tokenizer import TokenizerError, load_tokenizer
from megacann.data.tokenizer_files import generation_config, save_tokenizer, tokenizer_record
from megacann.interop.hf import save_hf_tensors, save_safetensors
from megacann.interop.names import CONSOLIDATED_CONFIG, GENERATION_CONFIG_FILE, TOKENIZER_DIR, WEIGHTS_FILE
from megacann.interop.reading import read_hf_weights, read_weights
from megacann.interop.tokenizer import source_tokenizer
from megacann.models import family_import

Log = Callable[[str], None]


def _fp8_dtype(dtype: Optional[str]) -> Optional[torch.dtype]:
    """What a Hugging Face source's fp8 weights are dequantised into: ``--dtype`` when given (no second
    rounding), else the dtype its config.json names."""
    return PRECISION_DTYPES[dtype] if dtype is not None else None


def cast_weights(tensors: dict[str, torch.Tensor], dtype: Optional[str]) -> dict[str, torch.Tensor]:
    """``tensors`` in the precision ``dtype`` names (fp32 / bf16 / fp16), or as they are for None."""
    if dtype is None:
        return tensors
    return {name: t.to(PRECISION_DTYPES[dtype]) for name, t in tensors.items()}


def write_consolidated(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out: str) -> None:
    """``model.safetensors`` and ``model_config.json`` of a consolidated directory."""
    os.makedirs(out, exist_ok=True)
    contiguous = {name: t.contiguous() for name, t in sorted(tensors.items())}
    save_safetensors(contiguous, os.path.join(out, WEIGHTS_FILE), metadata={"format": "pt", "producer": "megacann"})
    values = asdict(cfg)
    origin = family_import(cfg.type)
    if origin is not None:  # a family megacann does not ship: what a reader imports to know it
        values["imports"] = [origin]
    with open(os.path.join(out, CONSOLIDATED_CONFIG), "w") as f:
        json.dump(values, f, indent=1)


def consolidate(source: str, out: str, dtype: Optional[str] = None, log: Log = print) -> str:
    """Checkpoint (any layout) -> consolidated directory (with the run's tokenizer in ``tokenizer/``)."""
    tensors, cfg = read_weights(source, _fp8_dtype(dtype))
    write_consolidated_export(cast_weights(tensors, dtype), cfg, out, source_tokenizer(source, cfg, log))
    return out


def write_consolidated_export(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out: str, tokenizer: Any) -> None:
    """A consolidated directory of ``tensors``, with ``tokenizer`` (if any) in ``tokenizer/``."""
    write_consolidated(tensors, cfg, out)
    if tokenizer is not None:
        save_tokenizer(tokenizer, os.path.join(out, TOKENIZER_DIR))


def export_hf(
    source: str,
    out: str,
    dtype: Optional[str] = None,
    log: Log = print,
    fp8_block: Optional[tuple[int, int]] = None,
) -> str:
    """Checkpoint or consolidated directory -> Hugging Face directory (the family's adapter names the
    weights), with the run's tokenizer and a generation config naming its special tokens. Weights are
    written unquantised and config.json has no ``quantization_config`` (an fp8 source's are dequantised),
    unless ``fp8_block`` asks for DeepSeek-V3's block-scaled fp8 (:mod:`megacann.interop.quantized`)."""
    tensors, cfg = read_weights(source, _fp8_dtype(dtype))
    write_hf_export(cast_weights(tensors, dtype), cfg, out, source_tokenizer(source, cfg, log), fp8_block)
    return out


def write_hf_export(
    tensors: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out: str,
    tokenizer: Any,
    fp8_block: Optional[tuple[int, int]] = None,
) -> None:
    """A Hugging Face directory of ``tensors`` (the family's adapter names them) with ``tokenizer`` (if any)
    and a generation config naming its special tokens; ``fp8_block``: block-scaled fp8 projections."""
    token_ids = generation_config(tokenizer_record(tokenizer)) if tokenizer is not None else {}
    save_hf_tensors(tensors, cfg, out, extra_config=token_ids, fp8_block=fp8_block)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out, model_max_length=cfg.max_position_embeddings)
        with open(os.path.join(out, GENERATION_CONFIG_FILE), "w") as f:
            json.dump(token_ids, f, indent=1)


def import_hf(hf_dir: str, out: str, dtype: Optional[str] = None, log: Log = print) -> str:
    """Hugging Face directory -> consolidated directory (megacann names, e.g. fused qkv / gate-up), with the
    directory's tokenizer (if it has one) in ``tokenizer/``. Block-scaled fp8 weights (DeepSeek-V3's) are
    dequantised (:mod:`megacann.interop.quantized`)."""
    tensors, cfg = read_hf_weights(hf_dir, _fp8_dtype(dtype))
    write_consolidated(cast_weights(tensors, dtype), cfg, out)
    try:
        tokenizer = load_tokenizer(hf_dir)
    except TokenizerError as err:
        log(f"no tokenizer copied: {err}")
    else:
        save_tokenizer(tokenizer, os.path.join(out, TOKENIZER_DIR))
    return out
