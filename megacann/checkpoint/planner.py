"""torch.distributed.checkpoint (DCP) planners over pieces.

The state handed to DCP is a flat mapping ``key -> value``: a :class:`TensorPieces` (this rank's pieces
of one whole logical tensor) or any picklable object (RNG states, progress counters). DCP records every
tensor's global shape and the box of every stored chunk in its ``.metadata``, removes pieces that
several ranks hold alike (data-parallel replicas, tensor-parallel-replicated weights) so each is written
once by one of them, checks that the stored chunks tile every tensor, and on loading reads exactly the
overlaps between stored chunks and the pieces asked for. Pieces on an accelerator are copied through
the CPU.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megacann.checkpoint.pieces import Piece, split_piece

# the largest chunk a save writes: loading reads one stored chunk at a time (DCP's reader materialises the
# whole chunk before copying the part it needs), so this bounds what a load holds besides the training
# state (docs/checkpoints.md, "Memory while loading")
MAX_CHUNK_BYTES = 32 * 2**20


@dataclass
class TensorPieces:
    """This rank's pieces of one whole tensor of ``shape`` stored as ``dtype``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)

    def add(self, piece: Piece) -> None:
        if tuple(piece.tensor.shape) != tuple(piece.sizes):
            raise ValueError(f"piece at {piece.offsets}: view has shape {list(piece.tensor.shape)}, box {piece.sizes}")
        if all(s > 0 for s in piece.sizes):
            self.pieces.append(piece)

    def nbytes(self) -> int:
        return sum(p.tensor.numel() for p in self.pieces) * self.dtype.itemsize


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, start, length)
    return tensor


class PieceSavePlanner(DefaultSavePlanner):
    """Writes each rank's pieces as chunks of the whole tensors; DCP's global plan (deduplication of
    pieces held alike, metadata, the check that chunks tile each tensor) is kept as is."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False):
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator
        self._by_offset: dict[tuple[str, tuple[int, ...]], Piece] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, value in self.state_dict.items():
            if not isinstance(value, TensorPieces):
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
                continue
            properties = TensorProperties(dtype=value.dtype)
            pieces = [p for whole in value.pieces for p in split_piece(whole, MAX_CHUNK_BYTES)]
            for i, piece in enumerate(pieces):
                if (key, piece.offsets) in self._by_offset:  # the same box twice on one rank: write it once
                    continue
                self._by_offset[(key, piece.offsets)] = piece
                chunk = ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=torch.Size(piece.sizes))
                data = TensorWriteData(chunk=chunk, properties=properties, size=torch.Size(value.shape))
                items.append(
                    WriteItem(index=MetadataIndex(key, piece.offsets, i), type=WriteItemType.SHARD, tensor_data=data)
                )
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        key = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(self.state_dict[key], buffer)
            return buffer
        piece = self._by_offset[(key, tuple(write_item.index.offset))]
        tensor = piece.tensor.detach()
        if tensor.is_cpu and tensor.dtype == self.state_dict[key].dtype and _owns_storage(tensor):
            return tensor
        # a compact CPU copy: torch.save of a view would write the whole storage behind it
        out = torch.empty(piece.sizes, dtype=self.state_dict[key].dtype)
        out.copy_(tensor)
        return out


def _owns_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is exactly its storage (so saving it writes nothing more)."""
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


class PieceLoadPlanner(LoadPlanner):
    """Reads into each rank's pieces the overlaps of the stored chunks; objects are unpickled into
    :attr:`objects`."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Optional[Metadata] = None, is_coordinator=False):
        self.state_dict = state_dict
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for key, value in self.state_dict.items():
            stored = self.metadata.state_dict_metadata[key]
            if isinstance(value, TensorPieces):
                assert isinstance(stored, TensorStorageMetadata)
                chunks = [
                    ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes)) for p in value.pieces
                ]
                items += create_read_items_for_chunk_list(key, stored, chunks)
            else:
                index, zero = MetadataIndex(key), torch.Size((0,))
                items.append(
                    ReadItem(
                        type=LoadItemType.BYTE_IO,
                        dest_index=index,
                        dest_offsets=zero,
                        storage_index=index,
                        storage_offsets=zero,
                        lengths=zero,
                    )
                )
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        value = self.state_dict[read_item.dest_index.fqn]
        piece = value.pieces[read_item.dest_index.index]
        return _narrow(piece.tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass
