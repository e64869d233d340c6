"""Copies of the weights for the CPU products of a generate call (its decoding steps), in the layouts
that multiply a few rows fastest.

A decoding step multiplies a few rows (one a request) by every weight of the model. On CPU, PyTorch's fp32
``F.linear`` of 4 to 64 rows by a ``[out, in]`` weight was measured 1.3-2.2x slower than the same product
by a contiguous ``[in, out]`` copy of the weight (``torch.mm``), at one and two threads; at one row the two
are level, at two rows the copy is slower. A native bf16 ``F.linear`` (oneDNN, on a CPU with AVX-512 or
AMX) re-lays its weight out at every call: by a copy packed once (``torch.ops.mkldnn._reorder_linear_weight``)
the same product was 1.7x faster at 1 to 64 rows and gives the same bits (``benchmarks/NOTES.md``, "Issues
40 and 41 (session 15)"). Where bf16 or fp16 products run as fp32 GEMMs (:mod:`megacann.ops.bf16_matmul`: a
CPU without native GEMM for the dtype), each product widens its weight to fp32 first, which at a few rows
costs more than the product; a widened copy made once serves every step.

Inside :func:`call_weight_copies` (the generator enters it for a call), a no-grad CPU product whose
weight is a parameter reads such a copy: made at its first use in the block, remade when the parameter's
storage or version changes (an optimizer step, a ZeRO-3 gather), dropped at the block's end. fp32 weights
use the transposed copy from :data:`MIN_ROWS` rows and :data:`MIN_ELEMENTS` elements up (below, the call's
own overhead outweighs the gain), widened ones always, native bf16 ones the packed copy from
:data:`MIN_PACKED_ELEMENTS` up. Costs: one copy of each weight so read, for the block's length. fp32 and
widened results differ from ``F.linear``'s in the order of the fp32 sums only (round-off); the choice
depends on the rows, sizes and dtypes, never on a timing, so a call repeats bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Optional

import torch

MIN_ROWS = 4  # fp32 products of fewer rows keep F.linear (level at 1 row, faster at 2)
MIN_ELEMENTS = 1 << 17  # nor smaller fp32 weights (a 256 x 256 weight: level; 256 x 768: 1.2x faster)
MIN_PACKED_ELEMENTS = 1 << 18  # native bf16 weights packed from 512 x 512 (a packed call costs ~15 us more)
LOW = (torch.bfloat16, torch.float16)

_COPIES: Optional[dict[tuple[int, bool], tuple[torch.Tensor, int, int, torch.Tensor]]] = None  # (id, packed)


@contextlib.contextmanager
def call_weight_copies(enabled: bool = True) -> Iterator[None]:
    """Products inside the block read per-weight copies (transposed fp32 or oneDNN-packed: the module's
    docstring); a nested block shares the outer one's copies. ``enabled=False``: the plain products (no extra memory)."""
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


def _copy_of(weight: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """Parameter ``weight``'s copy for its current storage and version: the ``[in, out]`` fp32 one, or
    (``packed``) oneDNN's packed layout in the weight's own dtype."""
    assert _COPIES is not None
    key = (id(weight), packed)
    held = _COPIES.get(key)
    if held is None or held[0] is not weight or held[1] != weight.data_ptr() or held[2] != weight._version:
        if packed:
            copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        else:
            copy = torch.empty(weight.shape[::-1], dtype=torch.float32, device=weight.device)
            copy.copy_(weight.detach().t())
        held = (weight, weight.data_ptr(), weight._version, copy)
        _COPIES[key] = held
    return held[3]


@functools.cache
def packs_bf16() -> bool:
    """Whether this PyTorch packs linear weights for oneDNN (its ``mkldnn`` linear ops) and runs bf16
    products through oneDNN here (a CPU with AVX-512 or better, oneDNN not held below it), as ``F.linear``
    then does: the packed product gives its bits."""
    ops = torch.ops.mkldnn
    names = ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported")
    return (
        torch.backends.mkldnn.is_available() and all(hasattr(ops, n) for n in names) and ops._is_mkldnn_bf16_supported()
    )


def product(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], widened: bool = False
) -> Optional[torch.Tensor]:
    """``x @ weight.T + bias`` by the weight's copy where it applies (:func:`active`; a CPU parameter of two
    dims): fp32 with :data:`MIN_ROWS` rows and :data:`MIN_ELEMENTS` elements or more, or ``widened`` (the
    caller's product would upcast it; returns fp32, the caller rounds it), by the transposed fp32 copy;
    bf16 computed natively with :data:`MIN_PACKED_ELEMENTS` or more, by the packed copy (the same bits
    as ``F.linear``; fp16's packed product was not, so fp16 keeps ``F.linear``); else None."""
    if _COPIES is None or torch.is_grad_enabled() or not isinstance(weight, torch.nn.Parameter):
        return None  # not generating, training, or a view / gathered temporary (made once: no copy)
    if weight.dim() != 2 or weight.device.type != "cpu" or x.shape[-1] == 0:
        return None
    rows = x.numel() // x.shape[-1]
    if not widened and x.dtype == torch.bfloat16 and weight.dtype == x.dtype:  # a native bf16 product
        if weight.numel() < MIN_PACKED_ELEMENTS or not packs_bf16():
            return None
        return torch.ops.mkldnn._linear_pointwise(x, _copy_of(weight, packed=True), bias, "none", [], "")
    if not widened and (x.dtype != torch.float32 or weight.dtype != torch.float32):
        return None
    if not widened and (rows < MIN_ROWS or weight.numel() < MIN_ELEMENTS):
        return None
    if widened and x.dtype not in LOW:
        return None
    flat = x.reshape(rows, x.shape[-1])
    if widened:
        flat = flat.float()
    copy = _copy_of(weight)
    out = torch.mm(flat, copy) if bias is None else torch.addmm(bias.float(), flat, copy)
    return out.view(*x.shape[:-1], copy.shape[1])
