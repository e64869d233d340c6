"""Context parallelism for recurrent layers (Gated DeltaNet): what one chunk of the sequence hands the next.

In the load-balanced layout (:mod:`.layout`) cp rank ``r`` holds chunks ``r`` and ``2·cp-1-r`` of
``2·cp``. A recurrent layer's chunk needs two things from the chunks before it, in sequence order: the
last inputs of its short convolution (the left context) and the recurrent state at its first token.

The state is linear in the state the chunk starts from: ``end = P · start + local`` (per head, ``P``
``[dk, dk]``, ``local`` ``[dk, dv]``: the chunk run from a zero state). Every rank computes its chunks'
``(P, local)`` at once, one all-gather hands them round in sequence order, and each rank composes them
(a prefix over at most ``2·cp`` chunks of small matrices) to find the state entering each of its chunks.
So the chunks run in parallel instead of waiting for each other; the result equals one process running
the whole sequence. The gathers' backward sums every rank's gradient into the chunk that produced it.

A chunk whose first token starts a new document (packed sequences) takes nothing from before: its
``continues`` flag is false, which zeroes the state and masks the convolution's left taps.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megacann.layers.context_parallel.layout import context_parallel_chunk_ids
from megacann.layers.mappings import gather_from_sequence_parallel_region


def _sequence_order(cp_size: int, device: torch.device) -> torch.Tensor:
    """Index into the rank-major gather (rank, then its two chunks) that lists the chunks in sequence order."""
    position = {}
    for rank in range(cp_size):
        for slot, chunk in enumerate(context_parallel_chunk_ids(rank, cp_size)):
            position[chunk] = 2 * rank + slot
    return torch.tensor([position[c] for c in range(2 * cp_size)], device=device)


def gather_chunks(pieces: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``pieces`` ``[2, ...]`` (this rank's two chunks, in its local order) from every cp rank, as
    ``[2·cp, ...]`` in sequence order. Backward sums the gradients of all ranks into each owner's pieces."""
    gathered = gather_from_sequence_parallel_region(pieces.contiguous(), group, True, seq_dim=0)
    return gathered.index_select(0, _sequence_order(dist.get_world_size(group), pieces.device))


def local_chunk_ids(group: dist.ProcessGroup) -> tuple[int, int]:
    """The sequence positions (of ``2·cp``) of this rank's two chunks."""
    return context_parallel_chunk_ids(dist.get_rank(group), dist.get_world_size(group))


def left_context(
    chunks: torch.Tensor, segments: torch.Tensor, width: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` inputs before each of this rank's chunks, and their segment ids.

    ``chunks`` ``[2, b, c, channels]`` and ``segments`` ``[2, b, c]``: this rank's two chunks. Returns
    ``[2, b, width, channels]`` and ``[2, b, width]``; before the first token: zeros (segment id -1)."""
    keep = min(width, chunks.shape[2])  # a chunk shorter than the context hands all of it
    tails = gather_chunks(chunks[:, :, -keep:], group)  # [2cp, b, keep, channels]
    with torch.no_grad():
        tail_ids = gather_chunks(segments[:, :, -keep:], group)
    b, channels = chunks.shape[1], chunks.shape[3]
    ordered = torch.cat([tails.new_zeros((b, width, channels)), torch.cat(list(tails), dim=1)], dim=1)
    ordered_ids = torch.cat([tail_ids.new_full((b, width), -1), torch.cat(list(tail_ids), dim=1)], dim=1)
    lefts, ids = [], []
    for chunk in local_chunk_ids(group):  # the width rows just before the chunk's first tail row
        lefts.append(ordered[:, chunk * keep : chunk * keep + width])
        ids.append(ordered_ids[:, chunk * keep : chunk * keep + width])
    return torch.stack(lefts), torch.stack(ids)


def entering_states(
    transition: torch.Tensor, local: torch.Tensor, continues: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """The recurrent state at the first token of each of this rank's chunks.

    ``transition`` ``[2, b, h, dk, dk]`` and ``local`` ``[2, b, h, dk, dv]``: this rank's chunks' end
    state as ``transition @ start + local``; ``continues`` ``[2, b]`` (bool): the chunk's first token
    belongs to the document of the previous chunk's last token. Returns ``[2, b, h, dk, dv]``."""
    dk = transition.shape[-1]
    summary = gather_chunks(torch.cat([transition, local], dim=-1), group)  # [2cp, b, h, dk, dk + dv]
    with torch.no_grad():
        carried = gather_chunks(continues.to(local.dtype), group)  # [2cp, b]
    wanted = local_chunk_ids(group)
    state: Optional[torch.Tensor] = None
    entering = {}
    for chunk in range(max(wanted) + 1):
        start = local.new_zeros(local.shape[1:]) if state is None else state * carried[chunk][:, None, None, None]
        entering[chunk] = start
        step, add = summary[chunk].split([dk, summary.shape[-1] - dk], dim=-1)
        state = step @ start + add
    return torch.stack([entering[c] for c in wanted])
