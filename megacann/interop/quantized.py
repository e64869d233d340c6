"""Quantised Hugging Face checkpoints: block-scaled fp8 weights are dequantised as they are read; any other
quantisation is refused by name.

DeepSeek-V3's published weights (and others written in the same format) say in config.json::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

and store each quantised linear weight ``<name>.weight`` ([out, in]) as float8_e4m3fn beside
``<name>.weight_scale_inv`` (float32, [ceil(out / rows), ceil(in / cols)] for a block of ``[rows, cols]``):
the real weight is the fp8 value times its block's scale (the last blocks of a row or column may be
partial). Other tensors (norms, embeddings, the router, the head) are stored unquantised and have no scale.

:class:`DequantizingReader` wraps a reader of tensors by name: each fp8 weight is multiplied by its scales
in fp32, one tensor at a time, and comes out in the reader's dtype; the scales are consumed there and
never reach a model. Anything that does not fit (an fp8 weight without its scale, a scale without its
weight or of the wrong shape, an fp8 tensor where config.json names no quantisation) is an error naming
the file, the tensor and what was expected.

Exports are unquantised by default (an export of an fp8 checkpoint holds the dequantised weights and no
``quantization_config``); ``megacann-convert to-hf --fp8-block ROWS COLS`` writes this format instead
(:func:`quantize_hf_tensors`): every 2-D projection weight (``*_proj.weight``, ``*_proj_with_mqa.weight``:
attention, MLPs, experts; not the embedding, head, norms or router) is divided block by block by its
block's absolute maximum / 448 (the largest float8_e4m3fn) and rounded to float8_e4m3fn, the scale kept
as ``weight_scale_inv``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megacann.accelerator import PRECISION_DTYPES
from megacann.checkpoint.metadata import CheckpointError
from megacann.config import ConfigError

QUANTIZATION_KEY = "quantization_config"
SCALE_SUFFIX = "_scale_inv"  # <name>.weight -> <name>.weight_scale_inv
FP8_METHOD = "fp8"
# settings of quantization_config that must have this value when present (absent: the same, transformers'
# default), and why another is refused
_FIXED = {
    "fmt": ("e4m3", "weights stored as float8_e4m3fn"),
    "activation_scheme": ("dynamic", "no stored activation scales"),
    "scale_fmt": ("float", "float scales"),
    "expert_dtype": ("fp8", "experts in fp8 like every other weight"),
}
# settings that change nothing on reading: which modules were left unquantised (their tensors are not fp8
# and carry no scale, which is checked tensor by tensor) and what transformers does at load time
_INERT = {
    "quant_method",
    "weight_block_size",
    "modules_to_not_convert",
    "ignored_layers",
    "modules_to_convert",
    "dequantize",
}
# config.json's names (torch's, e.g. "bfloat16") of the dtypes megacann trains in
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in PRECISION_DTYPES.values()}
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BlockFP8:
    """``quant_method: fp8``: float8_e4m3fn weights with one scale per block of ``block`` = (rows, cols)."""

    block: tuple[int, int]

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The shape of the scales of a weight of ``shape`` [out, in]: one per (possibly partial) block."""
        return (math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1]))


def quantization_of(raw: Mapping[str, Any], config_file: str) -> Optional[BlockFP8]:
    """The quantisation config.json (``raw``, read from ``config_file``) declares: None when it declares
    none, :class:`BlockFP8` for block-scaled fp8; anything else is a ConfigError naming the key."""
    settings = raw.get(QUANTIZATION_KEY)
    if settings is None:
        return None
    where = f"{config_file}: {QUANTIZATION_KEY}"
    if not isinstance(settings, dict):
        raise ConfigError(f"{where} {settings!r} is not an object of quantisation settings")
    method = settings.get("quant_method")
    if method != FP8_METHOD:
        raise ConfigError(
            f"{where}: quant_method {method!r} is not supported: megacann reads block-scaled fp8 weights "
            f"(quant_method 'fp8' with weight_block_size, DeepSeek-V3's format) and no other quantisation; "
            "dequantise the weights to bf16 first"
        )
    for key, (value, meaning) in _FIXED.items():
        if settings.get(key, value) != value:
            raise ConfigError(f"{where}: {key} {settings[key]!r} is not supported (expected {value!r}: {meaning})")
    unknown = sorted(set(settings) - _INERT - set(_FIXED))
    if unknown:
        raise ConfigError(
            f"{where}: unknown setting(s) {unknown} of quant_method 'fp8' (megacann knows "
            f"{sorted(_INERT | set(_FIXED))})"
        )
    block = settings.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigError(
            f"{where}: weight_block_size {block!r} is not two positive integers (the rows and columns each "
            "scale covers, e.g. [128, 128])"
        )
    return BlockFP8((block[0], block[1]))


def stored_dtype(raw: Mapping[str, Any]) -> torch.dtype:
    """The dtype config.json names for the checkpoint's weights (``dtype`` or ``torch_dtype``; fp32 when it
    names none megacann trains in)."""
    name = raw.get("dtype") or raw.get("torch_dtype")
    return _DTYPES.get(name, torch.float32) if isinstance(name, str) else torch.float32


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight`` (fp8, [out, in]) times the scale of its block, in fp32: element (i, j) is multiplied by
    ``scale_inv[i // block[0], j // block[1]]``, in place on the fp32 copy (no weight-sized scale tensor)."""
    rows, cols = weight.shape
    out = weight.to(torch.float32)
    scale = scale_inv.to(torch.float32).repeat_interleave(block[0], dim=0)[:rows]  # [rows, column blocks]
    whole = cols // block[1]  # column blocks of full width; a last partial one is multiplied on its own
    if whole:
        out[:, : whole * block[1]].unflatten(1, (whole, block[1])).mul_(scale[:, :whole, None])
    if whole * block[1] < cols:
        out[:, whole * block[1] :].mul_(scale[:, whole:])
    return out


FP8_E4M3_MAX = 448.0
_QUANTISED_SUFFIXES = ("_proj.weight", "_proj_with_mqa.weight")


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as float8_e4m3fn and its ``weight_scale_inv`` (float32, one per block of
    ``block``, the last ones possibly partial): each block divided by its absolute maximum / 448 (an
    all-zero block gets scale 1)."""
    rows, cols = weight.shape
    scale_rows, scale_cols = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.zeros(scale_rows * block[0], scale_cols * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(scale_rows, block[0], scale_cols, block[1])
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    quantised = (tiles / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return quantised.contiguous(), scale


def quantize_hf_tensors(
    tensors: Mapping[str, torch.Tensor], block: tuple[int, int]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Hugging Face tensors in block-scaled fp8 (every 2-D projection weight, with its scales) and the
    ``quantization_config`` that says so."""
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"--fp8-block {list(block)} is not two positive integers (rows, columns), e.g. 128 128")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and name.endswith(_QUANTISED_SUFFIXES):
            out[name], out[name + SCALE_SUFFIX] = quantize_blocks(tensor, block)
        else:
            out[name] = tensor
    settings = {"quant_method": FP8_METHOD, "fmt": "e4m3", "activation_scheme": "dynamic"}
    return out, {**settings, "weight_block_size": list(block)}


def _is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1


class DequantizingReader:
    """Tensors by Hugging Face name from ``read`` (name -> tensor, names and files in ``weight_map``), each
    fp8 weight dequantised with its ``weight_scale_inv`` (``quant``; None: config.json declares no
    quantisation, so an fp8 tensor is an error) into ``dtype``. Other tensors come as stored."""

    def __init__(
        self,
        read: Callable[[str], torch.Tensor],
        weight_map: Mapping[str, str],
        path: str,
        quant: Optional[BlockFP8],
        dtype: torch.dtype = torch.float32,
    ):
        self.read, self.weight_map, self.path, self.quant, self.dtype = read, weight_map, path, quant, dtype
        orphans = [n for n in weight_map if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] not in weight_map]
        if orphans:
            name = orphans[0]
            raise CheckpointError(
                f"{self._where(name)}: block scale {name!r} has no weight {name[: -len(SCALE_SUFFIX)]!r} beside it "
                f"({len(orphans)} such scale(s))"
            )

    def _where(self, name: str) -> str:
        return os.path.join(self.path, self.weight_map.get(name, "?"))

    def __call__(self, name: str) -> torch.Tensor:
        tensor = self.read(name)
        scale_name = name + SCALE_SUFFIX
        has_scale = scale_name in self.weight_map
        if not _is_fp8(tensor):
            if has_scale:
                raise CheckpointError(
                    f"{self._where(name)}: tensor {name!r} is stored as {tensor.dtype} but has a block scale "
                    f"{scale_name!r} (only float8_e4m3fn weights have one)"
                )
            return tensor
        if self.quant is None:
            raise CheckpointError(
                f"{self._where(name)}: tensor {name!r} is stored as {tensor.dtype}, but config.json has no "
                f"{QUANTIZATION_KEY} saying how to read it"
            )
        if tensor.dtype != torch.float8_e4m3fn or tensor.dim() != 2:
            raise CheckpointError(
                f"{self._where(name)}: tensor {name!r} is {tensor.dtype} of shape {list(tensor.shape)}; "
                "quant_method 'fp8' (fmt e4m3) stores 2-D float8_e4m3fn weights"
            )
        if not has_scale:
            raise CheckpointError(
                f"{self._where(name)}: fp8 weight {name!r} has no block scale {scale_name!r} (quant_method 'fp8' "
                "stores one beside every fp8 weight)"
            )
        scale = self.read(scale_name)
        expected = self.quant.scale_shape(tuple(tensor.shape))
        if tuple(scale.shape) != expected or scale.dtype not in _SCALE_DTYPES:
            raise CheckpointError(
                f"{self._where(scale_name)}: block scale {scale_name!r} is {scale.dtype} of shape "
                f"{list(scale.shape)}; expected a float tensor of shape {list(expected)} (weight "
                f"{list(tensor.shape)} in blocks of {list(self.quant.block)}, the last ones partial)"
            )
        return dequantize_blocks(tensor, scale, self.quant.block).to(self.dtype)
