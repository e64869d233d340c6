"""Hugging Face checkpoints (config.json + safetensors) to and from any family with an HF adapter.

Offline only: a local directory is read or written. The family is found from config.json's
``model_type`` (:func:`megacann.models.spec.find_hf_family`); its :class:`~megacann.models.spec.HFAdapter`
(owned by the family, e.g. :mod:`megacann.models.hf_llama`) maps names and settings, this module does the
reading, sharding and writing.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.accelerator import PRECISION_DTYPES
from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.config.hf_config import read_hf_config
from megacann.interop.full_state import (
    checkpoint_buffers,
    full_state_dict,
    load_checkpoint_buffers_,
    load_full_state_dict_,
)
from megacann.interop.names import HF_CONFIG, SAFETENSORS_INDEX, WEIGHTS_FILE
from megacann.interop.quantized import DequantizingReader, quantization_of, stored_dtype
from megacann.interop.safetensors_file import SafetensorsFile
from megacann.layers import deferred_initialization
from megacann.models.spec import ChunkPlacement, ModelSpec, find_hf_family, get_model_spec, prepare_model_config


def hf_family(path: str) -> tuple[ModelSpec, ModelConfig, dict[str, Any]]:
    """The megacann family, model config and parsed config.json of a Hugging Face directory (the dict is
    for :func:`hf_weights_reader`, so an import reads config.json once). A ``quantization_config`` megacann
    cannot read (:mod:`megacann.interop.quantized`) is refused here."""
    config_file = os.path.join(path, HF_CONFIG)
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path}: no {HF_CONFIG} (expected a Hugging Face model directory)")
    raw = read_hf_config(config_file)
    spec = find_hf_family(raw.get("model_type", "llama"))
    quantization_of(raw, config_file)
    cfg = spec.hf.config_from_hf(config_file, raw=raw)
    if spec.hf.fit_to_weights is not None:
        spec.hf.fit_to_weights(cfg, checkpoint_holds(path), config_file)
    return spec, cfg, raw


def checkpoint_holds(path: str) -> Callable[[str], bool]:
    """Whether the safetensors checkpoint in ``path`` has a tensor of a name (a directory without one, e.g.
    a config.json alone, is taken to have every tensor)."""
    try:
        names = SafetensorsReader(path).weight_map
    except FileNotFoundError:
        return lambda name: True
    return names.__contains__


class SafetensorsReader:
    """Reads tensors by name from a single safetensors file or a sharded set with an index (each tensor
    read into its own memory, no file mapped: :mod:`megacann.interop.safetensors_file`)."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, SAFETENSORS_INDEX)
        self._handles: dict[str, SafetensorsFile] = {}
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
            self._handles[WEIGHTS_FILE] = SafetensorsFile(os.path.join(path, WEIGHTS_FILE))
            weight_map = dict.fromkeys(self._handles[WEIGHTS_FILE].keys(), WEIGHTS_FILE)
        else:
            raise FileNotFoundError(f"{path}: neither {WEIGHTS_FILE} nor {SAFETENSORS_INDEX} found")
        self.weight_map = weight_map

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        file = self.weight_map[name]
        if file not in self._handles:
            full = os.path.join(self.path, file)
            if not os.path.isfile(full):
                raise FileNotFoundError(f"{self.path}: shard {file} named by the index is missing")
            self._handles[file] = SafetensorsFile(full)
        return self._handles[file].get_tensor(name)


def hf_weights_reader(
    path: str, fp8_dtype: Optional[torch.dtype] = None, raw: Optional[dict[str, Any]] = None
) -> DequantizingReader:
    """Tensors of the Hugging Face directory ``path`` by name, as stored, except block-scaled fp8 weights
    (config.json's ``quantization_config``), which come dequantised into ``fp8_dtype`` (default: the dtype
    config.json names for the checkpoint, fp32 when none). ``raw``: config.json as :func:`hf_family`
    parsed it (None: read here)."""
    tensors = SafetensorsReader(path)
    config_file = os.path.join(path, HF_CONFIG)
    if raw is None:
        raw = read_hf_config(config_file) if os.path.isfile(config_file) else {}
    quant = quantization_of(raw, config_file)
    return DequantizingReader(tensors, tensors.weight_map, path, quant, fp8_dtype or stored_dtype(raw))


def from_pretrained_hf(
    path: str,
    precision: str = "fp32",
    device: Optional[Union[str, torch.device]] = None,
    sequence_parallel: bool = False,
    **overrides: Any,
) -> torch.nn.Module:
    """The whole model of a local HF directory (this rank's tensor-parallel slice), with its weights."""
    spec, model_cfg, raw = hf_family(path)
    for key, value in overrides.items():
        setattr(model_cfg, key, value)
    model_cfg.precision = precision
    cfg = MegacannConfig(model=model_cfg)
    cfg.distributed.tensor_parallel_size = ps.get_tensor_model_parallel_world_size()
    cfg.distributed.sequence_parallel = sequence_parallel
    prepare_model_config(cfg, spec, source=path)
    with deferred_initialization(weights_loaded=True):  # every weight is loaded below: none is drawn
        model = spec.build(cfg, ChunkPlacement(tuple(range(model_cfg.num_layers))), device)
    names = [name for name, _ in model.named_parameters()] + [name for name, _ in checkpoint_buffers(spec.hf, model)]
    reader = hf_weights_reader(path, PRECISION_DTYPES[precision], raw)
    tensors = spec.hf.from_hf(names, reader, model_cfg)
    load_full_state_dict_([model], tensors, source=path)
    load_checkpoint_buffers_(spec.hf, model, tensors, source=path)
    return model


def hf_adapter(cfg: ModelConfig):
    """The Hugging Face adapter of the family of ``cfg`` (an error names a family without one)."""
    spec = get_model_spec(cfg.type)
    if spec.hf is None:
        raise ConfigError(f"model family {cfg.type!r} has no Hugging Face adapter")
    return spec.hf


def write_hf_config(path: str, cfg: ModelConfig, dtype: torch.dtype, extra: Optional[dict[str, Any]] = None) -> None:
    """config.json of the family's adapter, with ``extra`` settings (e.g. the tokenizer's token ids) on top."""
    with open(os.path.join(path, HF_CONFIG), "w") as f:
        json.dump({**hf_adapter(cfg).config_to_hf(cfg, dtype), **(extra or {})}, f, indent=1)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, torch.Tensor], file: str, metadata: dict[str, str]) -> None:
    """``safetensors`` save with the permissions of any new file (0666 less the umask): the library
    itself creates its files readable by their owner only."""
    from safetensors.torch import save_file

    save_file(tensors, file, metadata=metadata)
    os.chmod(file, 0o666 & ~_umask())


def weights_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype config.json names: that of the first floating-point tensor (not an integer table's)."""
    return next(t.dtype for t in tensors.values() if t.is_floating_point())


def save_pretrained_hf(chunks: list[torch.nn.Module], path: str, cfg: ModelConfig) -> None:
    """Write a Hugging Face directory from this rank's model chunks. Collective over the tensor-parallel
    group; with pipeline stages every stage writes its own safetensors shard and the first the index."""
    if ps.get_expert_model_parallel_world_size() > 1:
        raise ValueError(
            "save_pretrained_hf: under expert parallelism each rank holds only its experts; save a checkpoint "
            "and write the Hugging Face directory with megacann-convert to-hf (any layout)"
        )
    adapter, whole = hf_adapter(cfg), full_state_dict(chunks)
    whole.update((name, buffer.detach()) for chunk in chunks for name, buffer in checkpoint_buffers(adapter, chunk))
    tensors = adapter.to_hf(whole, cfg)
    dtype = weights_dtype(tensors)
    pp_size, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    writes = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    file = WEIGHTS_FILE if pp_size == 1 else f"model-{pp_rank + 1:05d}-of-{pp_size:05d}.safetensors"
    if writes:
        os.makedirs(path, exist_ok=True)
        save_safetensors(tensors, os.path.join(path, file), metadata={"format": "pt"})
    if pp_size > 1:
        names = [None] * pp_size
        dist.all_gather_object(names, (file, sorted(tensors)), group=ps.get_pipeline_model_parallel_group())
        if writes and pp_rank == 0:
            weight_map = {name: f for f, keys in names for name in keys}
            with open(os.path.join(path, SAFETENSORS_INDEX), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    if writes and pp_rank == 0:
        write_hf_config(path, cfg, dtype)


def save_hf_tensors(
    tensors: dict[str, torch.Tensor],
    cfg: ModelConfig,
    path: str,
    extra_config: Optional[dict[str, Any]] = None,
    fp8_block: Optional[tuple[int, int]] = None,
) -> None:
    """Write whole megacann tensors held by one process (e.g. read from a checkpoint) as a Hugging Face
    directory with a single safetensors file (``extra_config`` goes into config.json); ``fp8_block``:
    projection weights in block-scaled fp8 with blocks of that [rows, cols]."""
    hf = hf_adapter(cfg).to_hf(tensors, cfg)
    dtype = weights_dtype(hf)
    if fp8_block is not None:  # DeepSeek-V3's block-scaled fp8 (megacann.interop.quantized)
        from megacann.interop.quantized import QUANTIZATION_KEY, quantize_hf_tensors

        hf, settings = quantize_hf_tensors(hf, fp8_block)
        extra_config = {**(extra_config or {}), QUANTIZATION_KEY: settings}
    os.makedirs(path, exist_ok=True)
    save_safetensors(hf, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    write_hf_config(path, cfg, dtype, extra_config)
