"""Transposed fp32 copies of the weights for the CPU products of a generate call (its decoding steps).

A decoding step multiplies a few rows (one a request) by every weight of the model. On CPU, PyTorch's fp32
``F.linear`` of 4 to 64 rows by a ``[out, in]`` weight was measured 1.3-2.2x slower than the same product
by a contiguous ``[in, out]`` copy of the weight (``torch.mm``), at one and two threads; at one row the two
are level, at two rows the copy is slower (``benchmarks/NOTES.md``, "Issue 40 (session 15)"). Where bf16 or
fp16 products run as fp32 GEMMs (:mod:`megacann.ops.bf16_matmul`: a CPU without native GEMM for the
dtype), each product widens its weight to fp32 first, which at a few rows costs more than the product; a
widened copy made once serves every step.

Inside :func:`transposed_weight_copies` (the generator enters it for a call), a no-grad CPU product whose
weight is a parameter reads such a copy: made at its first use in the block, remade when the parameter's
storage or version changes (an optimizer step, a ZeRO-3 gather), dropped at the block's end. fp32 weights
use it from :data:`MIN_ROWS` rows and :data:`MIN_ELEMENTS` elements up (below, the call's own overhead
outweighs the gain); widened weights always. Costs: one fp32 copy of
each weight so read, for the block's length. Results differ from ``F.linear``'s in the order of the fp32
sums only (round-off); the choice depends on the rows and the dtype, never on a timing, so a call repeats
bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch

MIN_ROWS = 4  # fp32 products of fewer rows keep F.linear (level at 1 row, faster at 2)
MIN_ELEMENTS = 1 << 17  # nor smaller fp32 weights (a 256 x 256 weight: level; 256 x 768: 1.2x faster)

_COPIES: Optional[dict[int, tuple[torch.Tensor, int, int, torch.Tensor]]] = None


@contextlib.contextmanager
def transposed_weight_copies(enabled: bool = True) -> Iterator[None]:
    """Products inside the block read per-weight transposed fp32 copies (the module's docstring); a nested
    block shares the outer one's copies. ``enabled=False``: the plain products (no extra memory)."""
    global _COPIES
    if not enabled or _COPIES is not None:
        yield
        return
    _COPIES = {}
    try:
        yield
    finally:
        _COPIES = None


def active() -> bool:
    """Whether products read the copies now (inside the block, gradients off)."""
    return _COPIES is not None and not torch.is_grad_enabled()


def _copy_of(weight: torch.Tensor) -> torch.Tensor:
    """The ``[in, out]`` fp32 copy of parameter ``weight`` for its current storage and version."""
    assert _COPIES is not None
    key = id(weight)
    held = _COPIES.get(key)
    if held is None or held[0] is not weight or held[1] != weight.data_ptr() or held[2] != weight._version:
        copy = torch.empty(weight.shape[::-1], dtype=torch.float32, device=weight.device)
        held = (weight, weight.data_ptr(), weight._version, copy.copy_(weight.detach().t()))
        _COPIES[key] = held
    return held[3]


def product(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], widened: bool = False
) -> Optional[torch.Tensor]:
    """``x @ weight.T + bias`` by the weight's copy where it applies (:func:`active`; a CPU parameter of two
    dims; fp32 with :data:`MIN_ROWS` rows and :data:`MIN_ELEMENTS` elements or more, or ``widened``: the
    caller's product would upcast it), else None. A widened product returns fp32; the caller rounds it."""
    if _COPIES is None or torch.is_grad_enabled() or not isinstance(weight, torch.nn.Parameter):
        return None  # not generating, training, or a view / gathered temporary (made once: no copy)
    if weight.dim() != 2 or weight.device.type != "cpu" or x.shape[-1] == 0:
        return None
    rows = x.numel() // x.shape[-1]
    if not widened and (x.dtype != torch.float32 or weight.dtype != torch.float32):
        return None
    if not widened and (rows < MIN_ROWS or weight.numel() < MIN_ELEMENTS):
        return None
    if widened and x.dtype not in (torch.bfloat16, torch.float16):
        return None
    flat = x.reshape(rows, x.shape[-1])
    if widened:
        flat = flat.float()
    copy = _copy_of(weight)
    out = torch.mm(flat, copy) if bias is None else torch.addmm(bias.float(), flat, copy)
    return out.view(*x.shape[:-1], copy.shape[1])
