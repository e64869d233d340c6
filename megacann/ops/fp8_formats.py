"""FP8 scaling recipes: how a GEMM operand is cut into blocks, each block scaled into an FP8 format.

Every GEMM here is written ``A @ B.T`` with both operands 2-D and the reduction dimension last, so a
recipe is one rule for all three products of a linear layer (forward ``x @ w.T``, input gradient
``dy @ (w.T).T``, weight gradient ``dy.T @ (x.T).T``): each operand is scaled in blocks of
``(rows, cols)`` of its own ``[rows, reduction]`` view.

==========  ===========================================  ==========================================
recipe      activations and gradients                    weights
==========  ===========================================  ==========================================
tensorwise  one scale for the tensor                     one scale for the tensor
rowwise     one scale per row (along the reduction)      one scale per row (along the reduction)
blockwise   1 x 128 tiles (DeepSeek-V3)                  128 x 128 blocks (DeepSeek-V3)
mxfp8       1 x 32 blocks, power-of-two (E8M0) scales    1 x 32 blocks, power-of-two scales (OCP MX)
==========  ===========================================  ==========================================

A scale is the dequantisation multiplier: ``value ≈ fp8 * scale`` with ``scale = amax / fmax`` (1 for an
all-zero block), so a block's largest magnitude lands on the format's largest finite value. MX scales are
rounded *up* to a power of two (``2^ceil(log2(amax / fmax))``), so no element saturates.

When a block spans a dimension that is split over ranks (a tensorwise scale of a tensor-parallel weight
shard, a row of a row-parallel input whose reduction dimension is sharded), its amax is the maximum over
every rank holding a piece of it: :func:`quantize` reduces it over ``amax_group``. Forgetting that
reduction is the classic FP8 bug in model-parallel code: every rank then scales the same tensor
differently and the run no longer equals one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from megacann.errors import MegacannError

FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")
ROLES = ("activation", "weight", "gradient")
# (rows, cols) of a block of an operand's [rows, reduction] view; None: the whole dimension
_BLOCKS: dict[str, dict[str, tuple[Optional[int], Optional[int]]]] = {
    "tensorwise": {"activation": (None, None), "weight": (None, None), "gradient": (None, None)},
    "rowwise": {"activation": (1, None), "weight": (1, None), "gradient": (1, None)},
    "blockwise": {"activation": (1, 128), "weight": (128, 128), "gradient": (1, 128)},
    "mxfp8": {"activation": (1, 32), "weight": (1, 32), "gradient": (1, 32)},
}
E8M0_EXPONENTS = (-127, 127)  # the exponents an OCP E8M0 scale represents


class Fp8Error(MegacannError, ValueError):
    """An FP8 recipe that cannot apply: unknown name, a block size that does not divide a shape."""


def fp8_dtype(name: str) -> torch.dtype:
    """The torch dtype of an FP8 format name (``e4m3``: float8_e4m3fn, ``e5m2``: float8_e5m2)."""
    if name not in FORMATS:
        raise Fp8Error(f"unknown FP8 format {name!r}: expected one of {', '.join(FORMATS)}")
    return FORMATS[name]


def fp8_max(name: str) -> float:
    """The largest finite value of an FP8 format (e4m3: 448, e5m2: 57344)."""
    return float(torch.finfo(fp8_dtype(name)).max)


def check_recipe(recipe: str) -> str:
    if recipe not in RECIPES:
        raise Fp8Error(f"unknown FP8 recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    return recipe


def block_shape(recipe: str, role: str) -> tuple[Optional[int], Optional[int]]:
    """The block ``(rows, cols)`` a recipe scales an operand of ``role`` in (None: the whole dimension)."""
    if role not in ROLES:
        raise Fp8Error(f"unknown operand role {role!r}: expected one of {', '.join(ROLES)}")
    return _BLOCKS[check_recipe(recipe)][role]


def power_of_two_scales(recipe: str) -> bool:
    """Whether the recipe's scales are powers of two (MX's E8M0)."""
    return check_recipe(recipe) == "mxfp8"


@dataclass(frozen=True)
class Quantized:
    """An operand in FP8: ``data`` and one fp32 ``scale`` per block ``[rows / block_rows, cols / block_cols]``;
    ``block`` as resolved for this tensor; ``shape`` the operand's own shape (``data`` may be zero-padded
    beyond it to whole blocks)."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """The fp32 values the FP8 data stands for (each element times its block's scale), at ``shape``."""
        values = self.data.float() * expand_scale(self.scale, self.block)
        return values[: self.shape[0], : self.shape[1]]


def resolve_block(shape: tuple[int, int], block: tuple[Optional[int], Optional[int]], what: str) -> tuple[int, int]:
    """The block as whole numbers for a 2-D ``shape``; an error naming ``what`` when it does not divide."""
    resolved = tuple(size if b is None else b for size, b in zip(shape, block))
    for dim, (size, b) in enumerate(zip(shape, resolved)):
        if size % b:
            raise Fp8Error(
                f"{what}: FP8 blocks of {resolved[0]} x {resolved[1]} do not divide its shape "
                f"{shape[0]} x {shape[1]} (dimension {dim} is {size}, not a multiple of {b})"
            )
    return resolved  # type: ignore[return-value]


def expand_scale(scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each block's scale repeated over its elements."""
    return scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)


def block_amax(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The largest magnitude in each ``block`` of a 2-D tensor, fp32 ``[rows / br, cols / bc]``."""
    rows, cols = t.shape
    br, bc = block
    return t.detach().abs().float().reshape(rows // br, br, cols // bc, bc).amax(dim=(1, 3))


AmaxGroups = Union[dist.ProcessGroup, tuple[dist.ProcessGroup, ...], None]


def measured_amax(t: torch.Tensor, block: tuple[int, int], group: AmaxGroups = None) -> torch.Tensor:
    """:func:`block_amax`, reduced to the maximum over ``group`` (the ranks holding other pieces of the blocks;
    a tuple of groups: over each in turn, e.g. tensor- and context-parallel ranks, which the maximum composes)."""
    amax = block_amax(t, block)
    for g in group if isinstance(group, tuple) else (group,):
        if g is not None and dist.get_world_size(g) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=g)
    return amax


def scales_from_amax(amax: torch.Tensor, fmt: str, power_of_two: bool = False) -> torch.Tensor:
    """Dequantisation scales ``amax / fmax`` (1 where a block is all zero); rounded up to powers of two
    within E8M0's range when ``power_of_two``."""
    scale = torch.where(amax > 0, amax / fp8_max(fmt), torch.ones_like(amax))
    if power_of_two:
        low, high = E8M0_EXPONENTS
        scale = torch.exp2(torch.ceil(torch.log2(scale)).clamp(low, high))
    return scale


def quantize(
    t: torch.Tensor,
    fmt: str,
    block: tuple[Optional[int], Optional[int]],
    *,
    power_of_two: bool = False,
    amax_group: AmaxGroups = None,
    amax: Optional[torch.Tensor] = None,
    pad: tuple[bool, bool] = (False, False),
    what: str = "tensor",
) -> Quantized:
    """``t`` (2-D) in FP8 format ``fmt``, one scale per ``block``. ``amax_group``: the ranks that hold the
    other pieces of the blocks (their amax is reduced to the maximum over them). ``amax``: use these
    per-block maxima instead of measuring ``t`` (delayed scaling); values beyond them saturate.
    ``pad`` (rows, cols): whether a dimension that is no whole number of blocks is zero-padded to one (the
    last blocks then scale the elements they have) instead of refused; refuse where the dimension is split
    over ranks, since each rank's blocks must then be the blocks one process has."""
    if t.dim() != 2:
        raise Fp8Error(f"{what}: FP8 quantisation takes a 2-D operand, got shape {tuple(t.shape)}")
    shape = tuple(t.shape)
    extra = [(-size) % b if (b is not None and allowed) else 0 for size, b, allowed in zip(shape, block, pad)]
    if any(extra):
        t = torch.nn.functional.pad(t, (0, extra[1], 0, extra[0]))
    resolved = resolve_block(tuple(t.shape), block, what)
    if amax is None:
        amax = measured_amax(t, resolved, amax_group)
    scale = scales_from_amax(amax, fmt, power_of_two)
    limit = fp8_max(fmt)
    scaled = t.float() / expand_scale(scale, resolved)
    data = scaled.clamp(-limit, limit).to(fp8_dtype(fmt))
    return Quantized(data, scale, resolved, shape)


def fake_quantize(t: torch.Tensor, fmt: str, block: tuple[Optional[int], Optional[int]], **options) -> torch.Tensor:
    """``t`` rounded through FP8 and back (fp32): the values an FP8 GEMM multiplies."""
    return quantize(t, fmt, block, **options).dequantize()


def relative_error_bound(fmt: str) -> float:
    """Half an ulp of the format's mantissa at 1.0 (e4m3: 2^-4, e5m2: 2^-3): the largest relative error of a
    normal value rounded to nearest, with its block scaled into range."""
    mantissa_bits = {"e4m3": 3, "e5m2": 2}[fmt]
    return math.ldexp(1.0, -(mantissa_bits + 1))
