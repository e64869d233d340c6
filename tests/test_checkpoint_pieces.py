"""Pieces: every layout's local data maps onto exactly the right boxes of the whole logical tensor."""

import itertools
import math

import pytest
import torch

from megacann.checkpoint.pieces import flat_range_boxes, range_pieces, tensor_pieces
from megacann.layers.sharding import ParamSharding, shard_tensor

SHARDINGS = {
    "replicated_2d": ParamSharding((6, 5)),
    "column": ParamSharding((8, 3), tp_dim=0),
    "row": ParamSharding((3, 8), tp_dim=1),
    "fused_qkv": ParamSharding((16, 3), tp_dim=0, tp_blocks=(8, 4, 4)),
    "fused_row_blocks": ParamSharding((2, 12), tp_dim=1, tp_blocks=(8, 4)),
    "vocab_padded": ParamSharding((16, 3), tp_dim=0, logical_size=13),
    "vocab_mostly_padding": ParamSharding((16, 2), tp_dim=0, logical_size=3),
    "bias": ParamSharding((8,), tp_dim=0),
    "norm": ParamSharding((5,)),
    "three_d": ParamSharding((2, 8, 3), tp_dim=1, tp_blocks=(4, 4)),
}


@pytest.mark.parametrize(
    "shape,start,end", [((4, 5), 3, 17), ((4, 5), 0, 20), ((4, 5), 5, 10), ((2, 3, 4), 1, 23), ((7,), 2, 5)]
)
def test_flat_range_boxes_cover_the_range_contiguously(shape, start, end):
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape)
    covered = []
    for (offsets, sizes), first in flat_range_boxes(shape, start, end):
        region = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
        assert region.tolist() == list(range(first, first + region.numel()))  # contiguous, starts at first
        covered += region.tolist()
    assert covered == list(range(start, end))
    assert len(flat_range_boxes(shape, start, end)) <= 2 * len(shape) - 1


def _ranges(numel: int, parts: int) -> list[tuple[int, int]]:
    """Uneven split of [0, numel) into parts (some possibly empty), as ZeRO's flat buffer may cut it."""
    cuts = sorted({0, numel, *(numel * k // parts + (k % 2) for k in range(1, parts))})
    cuts = [min(max(c, 0), numel) for c in cuts]
    return list(zip(cuts[:-1], cuts[1:]))


@pytest.mark.parametrize("name", sorted(SHARDINGS))
@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("dp_parts", [1, 3])
def test_pieces_of_every_rank_tile_the_logical_tensor(name, tp_size, dp_parts):
    sharding = SHARDINGS[name]
    blocks = sharding.tp_blocks or ((sharding.full_shape[sharding.tp_dim],) if sharding.tp_dim is not None else ())
    if any(b % tp_size for b in blocks):
        pytest.skip("not divisible")
    logical = sharding.logical_shape
    whole = torch.randn(logical)
    padded = torch.zeros(sharding.full_shape)
    padded[tuple(slice(0, s) for s in logical)] = whole
    seen = torch.zeros(logical, dtype=torch.int32)
    for tp_rank in range(tp_size if sharding.tp_dim is not None else 1):
        local = shard_tensor(padded, sharding, tp_rank, tp_size)
        flat = local.view(-1)
        for start, end in _ranges(flat.numel(), dp_parts):
            for piece in range_pieces(flat[start:end], start, end, sharding, tp_rank, tp_size):
                box = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))
                assert tuple(piece.tensor.shape) == piece.sizes
                assert torch.equal(piece.tensor, whole[box])
                seen[box] += 1
                assert piece.tensor.data_ptr() >= flat.data_ptr()  # a view of local memory, not a copy
        # the whole-shard helper gives the same boxes as one range
        boxes = {(p.offsets, p.sizes) for p in tensor_pieces(local, sharding, tp_rank, tp_size)}
        assert boxes == {(p.offsets, p.sizes) for p in range_pieces(flat, 0, flat.numel(), sharding, tp_rank, tp_size)}
    assert torch.all(seen == 1), f"{name}: every logical element exactly once"


def test_loading_through_pieces_writes_local_memory():
    sharding = SHARDINGS["fused_qkv"]
    whole = torch.randn(sharding.full_shape)
    for tp_rank, (start, end) in itertools.product(range(2), [(0, 24), (5, 19)]):
        local = torch.zeros(sharding.local_shape(2))
        flat = local.view(-1)
        for piece in range_pieces(flat[start:end], start, end, sharding, tp_rank, 2):
            piece.tensor.copy_(whole[tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))])
        expected = shard_tensor(whole, sharding, tp_rank, 2).view(-1)
        assert torch.equal(flat[start:end], expected[start:end])
        assert not flat[:start].any() and not flat[end:].any()
