"""Where a rank's local data sits inside the whole, unpadded (logical) tensor of a parameter.

A checkpoint stores every tensor whole and layout-free; each rank contributes (or asks for) rectangular
*pieces* of it. A piece pairs a box of the logical tensor (``offsets``, ``sizes``) with a view of the
rank's own memory holding exactly that box, so saving reads the view and loading copies into it.

The local data of a parameter is a flat range ``[start, end)`` of its flattened tensor-parallel shard:
the whole shard for model weights and plain data parallelism, one range per data-parallel rank with
ZeRO. A flat range is cut into boxes that are each contiguous in memory (at most ``2·ndim - 1``), and
each box is mapped into the logical tensor: split at the fused blocks of ``tp_dim`` (each block is
split across TP ranks on its own), shifted to this TP rank's slice, and clipped to ``logical_size``
(rows of vocabulary padding, which differ per TP size, are never stored).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from megacann.layers.sharding import ParamSharding

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass
class Piece:
    """A box of a logical tensor and the view of local memory that holds it (``tensor.shape == sizes``)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[tuple[Box, int]]:
    """Boxes covering elements ``[start, end)`` of a row-major tensor of ``shape``, in order, each
    contiguous in memory; returned with the flat index of their first element."""
    shape = tuple(shape)
    if start >= end:
        return []
    if not shape:  # a scalar
        return [(((), ()), 0)]
    inner = math.prod(shape[1:])
    boxes: list[tuple[Box, int]] = []

    def part_of_row(row: int, lo: int, hi: int) -> None:
        for (offsets, sizes), first in flat_range_boxes(shape[1:], lo, hi):
            boxes.append((((row, *offsets), (1, *sizes)), row * inner + first))

    first_full, end_full = -(-start // inner), end // inner  # whole rows [first_full, end_full)
    if first_full > end_full:  # inside one row
        row = start // inner
        part_of_row(row, start - row * inner, end - row * inner)
        return boxes
    if start < first_full * inner:
        part_of_row(first_full - 1, start - (first_full - 1) * inner, inner)
    if end_full > first_full:
        boxes.append(
            (((first_full,) + (0,) * (len(shape) - 1), (end_full - first_full, *shape[1:])), first_full * inner)
        )
    if end > end_full * inner:
        part_of_row(end_full, 0, end - end_full * inner)
    return boxes


def _to_logical(
    box: Box, sharding: ParamSharding, tp_rank: int, tp_size: int
) -> list[tuple[Box, Optional[tuple[int, int]]]]:
    """Map a box of the local TP shard to boxes of the logical tensor, each with the (start, length)
    along ``tp_dim`` of the part of the local box it covers (None: all of it)."""
    offsets, sizes = box
    dim = sharding.tp_dim
    if dim is None:
        return [(box, None)]
    blocks = sharding.tp_blocks or (sharding.full_shape[dim],)
    if sharding.logical_size is not None and len(blocks) > 1:
        raise ValueError("a padded tensor (logical_size) with fused tp_blocks is not supported")
    lo, hi = offsets[dim], offsets[dim] + sizes[dim]
    out = []
    local_start = full_start = 0
    for block in blocks:
        local = block // tp_size
        a, b = max(lo, local_start), min(hi, local_start + local)
        if a < b:
            first = full_start + tp_rank * local + (a - local_start)
            length = b - a
            if sharding.logical_size is not None:
                length = min(length, sharding.logical_size - first)
            if length > 0:
                new_offsets, new_sizes = list(offsets), list(sizes)
                new_offsets[dim], new_sizes[dim] = first, length
                out.append(((tuple(new_offsets), tuple(new_sizes)), (a - lo, length)))
        local_start += local
        full_start += block
    return out


def range_pieces(
    flat: torch.Tensor, start: int, end: int, sharding: ParamSharding, tp_rank: int, tp_size: int
) -> list[Piece]:
    """Pieces of the logical tensor held by ``flat``, a 1-D view of elements ``[start, end)`` of this
    TP rank's flattened shard."""
    if flat.dim() != 1 or flat.numel() != end - start:
        raise ValueError(f"expected a 1-D view of {end - start} elements, got shape {list(flat.shape)}")
    local_shape = sharding.local_shape(tp_size)
    pieces = []
    for (offsets, sizes), first in flat_range_boxes(local_shape, start, end):
        numel = math.prod(sizes)
        box_view = flat[first - start : first - start + numel].view(sizes)
        for (full_offsets, full_sizes), cut in _to_logical((offsets, sizes), sharding, tp_rank, tp_size):
            view = box_view if cut is None else box_view.narrow(sharding.tp_dim, *cut)
            pieces.append(Piece(full_offsets, full_sizes, view))
    return pieces


def tensor_pieces(local: torch.Tensor, sharding: ParamSharding, tp_rank: int, tp_size: int) -> list[Piece]:
    """Pieces of the logical tensor held by a whole local TP shard (a model parameter)."""
    if not local.is_contiguous():
        raise ValueError(f"expected a contiguous local shard, got strides {local.stride()}")
    if tuple(local.shape) != tuple(sharding.local_shape(tp_size)):
        raise ValueError(
            f"local shard has shape {list(local.shape)}, its sharding says {list(sharding.local_shape(tp_size))}"
        )
    return range_pieces(local.detach().view(-1), 0, local.numel(), sharding, tp_rank, tp_size)


def split_piece(piece: Piece, limit_bytes: int) -> list[Piece]:
    """``piece`` cut into pieces of at most ``limit_bytes`` each (blocks of rows; a row over the limit is cut
    along its next dimension, and so on), so that no stored chunk, and so nothing a load reads at once, is
    larger than the limit. Deterministic: ranks holding the same piece cut it alike."""
    itemsize = piece.tensor.element_size()
    sizes = piece.sizes
    if not sizes or math.prod(sizes) * itemsize <= limit_bytes or sizes[0] == 0:
        return [piece]
    row = math.prod(sizes[1:]) * itemsize
    step = max(1, limit_bytes // row) if row else sizes[0]
    out = []
    for start in range(0, sizes[0], step):
        length = min(step, sizes[0] - start)
        offsets = (piece.offsets[0] + start, *piece.offsets[1:])
        block = Piece(offsets, (length, *sizes[1:]), piece.tensor.narrow(0, start, length))
        if length == 1 and row > limit_bytes and len(sizes) > 1:  # one row, still too large: cut inside it
            inner = Piece(block.offsets[1:], block.sizes[1:], block.tensor[0])
            out += [
                Piece((block.offsets[0], *p.offsets), (1, *p.sizes), p.tensor.unsqueeze(0))
                for p in split_piece(inner, limit_bytes)
            ]
        else:
            out.append(block)
    return out
