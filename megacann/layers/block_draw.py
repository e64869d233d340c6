"""Initial values drawn block by block, so a rank draws only what it keeps and every layout agrees.

A parameter's whole (logical, unpadded) tensor is cut into slabs along one dimension, its *block dim*: the
dimension tensor parallelism splits (``tp_dim``), else dim 0, unless the parameter names another one
(``BLOCK_DIM_ATTR``, for a parameter split in some layouts and whole in others). The slab thickness
depends only on the whole tensor's shape (:func:`block_extent`), and slab ``k`` is drawn by the
parameter's init method from a generator seeded with ``block_seed(parameter seed, k)``. A rank draws only
the slabs that meet the rows it keeps and copies those rows into its shard, so

- every TP size, pipeline split and expert-parallel placement starts from the same values (a value's slab
  and seed never depend on the layout);
- a rank draws its share plus at most the slabs cut by its shard's edges: none when the thickness divides
  the shard's boundaries, which :func:`block_extent` arranges for power-of-two TP sizes up to 64.

An init method is applied to each slab on its own, so it must treat every element alike (normal, uniform,
constant), never read the tensor's shape (a fan-based init gets the slab's fan: give it its bound instead).
:func:`count_drawn_values` counts what is drawn, for tests and the start-up benchmark.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable, Optional

import torch

if TYPE_CHECKING:  # sharding imports this module
    from megacann.layers.sharding import ParamSharding

BLOCK_DIM_ATTR = "megacann_block_dim"  # the dim a parameter is drawn in slabs along, when not its tp_dim
ALIGNED_SPLITS = 64  # slab thickness divides size / 64 where it can: TP sizes up to 64 cut no slab
MIN_BLOCK_VALUES = 4096  # thinner slabs are merged up to this many values (the seeding costs ~5 us a slab)
_MASK64 = (1 << 64) - 1
_counters: list[list[int]] = []


def block_extent(shape: tuple[int, ...], dim: int) -> int:
    """The slab thickness along ``dim`` of a tensor whose whole shape is ``shape``: the largest power of
    two dividing ``shape[dim] / 64`` (1 if none), doubled while a slab holds fewer than
    ``MIN_BLOCK_VALUES`` values and the double still divides ``shape[dim]``; at most ``shape[dim]``."""
    size = shape[dim] if shape else 1
    if size == 0:
        return 1
    across = math.prod(shape) // size if shape else 1
    two_adic = size & -size  # the largest power of two dividing size
    extent = max(1, two_adic // ALIGNED_SPLITS)
    while extent * across < MIN_BLOCK_VALUES and extent < two_adic:
        extent *= 2
    if extent * across < MIN_BLOCK_VALUES:  # an odd-sized small tensor: one slab
        extent = size
    return min(extent, size)


def block_seed(parameter_seed: int, index: int) -> int:
    """The seed of slab ``index`` of the parameter seeded ``parameter_seed`` (a splitmix64 mix of both)."""
    x = (parameter_seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # 63 bits: any torch generator takes it


def block_dim(param: torch.Tensor, sharding: ParamSharding) -> int:
    """The dimension ``param`` is drawn in slabs along (see the module docstring)."""
    named = getattr(param, BLOCK_DIM_ATTR, None)
    if named is not None:
        if sharding.tp_dim is not None and named != sharding.tp_dim:
            raise ValueError(f"block dim {named} differs from the parameter's tp_dim {sharding.tp_dim}")
        return named
    return sharding.tp_dim if sharding.tp_dim is not None else 0


def kept_ranges(sharding: ParamSharding, dim: int, tp_rank: int, tp_size: int) -> list[tuple[int, int, int]]:
    """``(start, stop, local start)`` along ``dim`` of the whole logical tensor's rows this TP rank keeps,
    one range per fused block (``tp_blocks``), padding rows left out."""
    logical = sharding.logical_shape
    if sharding.tp_dim is None or tp_size == 1:
        return [(0, logical[dim] if logical else 1, 0)]
    ranges, offset, local = [], 0, 0
    for block in sharding.tp_blocks or (sharding.full_shape[dim],):
        share = block // tp_size
        start = offset + tp_rank * share
        stop = min(start + share, logical[dim])
        if stop > start:
            ranges.append((start, stop, local))
        offset, local = offset + block, local + share
    return ranges


@contextlib.contextmanager
def count_drawn_values() -> Iterator[list[int]]:
    """Counts the values drawn inside the block (``counter[0]``), slabs drawn whole."""
    counter = [0]
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def _draw_block(shape: tuple[int, ...], init_method: Callable[[torch.Tensor], object], seed: int) -> torch.Tensor:
    block = torch.empty(shape, dtype=torch.float32, device="cpu")
    torch.default_generator.manual_seed(seed)  # init methods draw from the default CPU generator
    init_method(block)
    for counter in _counters:
        counter[0] += block.numel()
    return block


@torch.no_grad()
def draw_shard_(
    param: torch.Tensor,
    sharding: ParamSharding,
    init_method: Callable[[torch.Tensor], object],
    seed: Optional[int],
    tp_rank: int,
    tp_size: int,
) -> None:
    """Fill ``param`` (this TP rank's shard) with its slabs of the whole tensor, drawn from ``seed`` (None:
    one seed drawn from torch's CPU RNG, so ranks whose RNG agrees agree). Padding rows are zero; a
    parameter on the meta device is left alone and takes nothing from the RNG."""
    if param.is_meta:
        return
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), device="cpu"))
    logical = sharding.logical_shape
    if not logical:  # a scalar: one block
        with torch.random.fork_rng(devices=[]):
            param.copy_(_draw_block((), init_method, block_seed(seed, 0)))
        return
    dim = block_dim(param, sharding)
    extent = block_extent(logical, dim)
    if sharding.logical_size is not None and sharding.tp_dim is not None:
        param.zero_()  # the padding rows
    last: Optional[tuple[int, torch.Tensor]] = None  # a slab met by two fused blocks is drawn once
    with torch.random.fork_rng(devices=[]):
        for start, stop, local in kept_ranges(sharding, dim, tp_rank, tp_size):
            for index in range(start // extent, -(-stop // extent)):
                first = index * extent
                if last is None or last[0] != index:
                    shape = list(logical)
                    shape[dim] = min(extent, logical[dim] - first)
                    last = (index, _draw_block(tuple(shape), init_method, block_seed(seed, index)))
                lo, hi = max(start, first), min(stop, first + extent)
                param.narrow(dim, local + lo - start, hi - lo).copy_(last[1].narrow(dim, lo - first, hi - lo))
