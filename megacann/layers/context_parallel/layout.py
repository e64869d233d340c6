"""The load-balanced layout of context parallelism: which tokens of a sequence each cp rank holds.

A sequence of length ``s`` is cut into ``2·cp`` equal chunks and cp rank ``i`` holds chunks ``i`` and
``2·cp-1-i`` (Megatron-Core's load-balanced layout): with a causal mask the early chunk sees few keys and
the late one many, so every rank does the same attention work. :func:`context_parallel_split` takes a
rank's share of any ``[b, s, ...]`` tensor (tokens, labels, position ids, segment ids),
:func:`context_parallel_batch` of a whole micro-batch (what the pipeline schedules hand the model),
:func:`context_parallel_gather` puts the shares back in order, :func:`context_parallel_position_ids`
names the global positions of a rank's tokens (for rotary embeddings).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.layers.mappings import gather_from_sequence_parallel_region

Group = Optional[dist.ProcessGroup]


def cp_group(group: Group) -> tuple[Group, int, int]:
    """(group, size, rank): ``group`` if given, else parallel_state's context-parallel group."""
    if group is not None:
        return group, dist.get_world_size(group), dist.get_rank(group)
    return (
        ps.get_context_parallel_group(),
        ps.get_context_parallel_world_size(),
        ps.get_context_parallel_rank(),
    )


def _size_rank(cp_size: Optional[int], cp_rank: Optional[int]) -> tuple[int, int]:
    size = ps.get_context_parallel_world_size() if cp_size is None else cp_size
    rank = ps.get_context_parallel_rank() if cp_rank is None else cp_rank
    if not 0 <= rank < size:
        raise ValueError(f"context-parallel rank {rank} is outside [0, context_parallel_size {size})")
    return size, rank


def chunk_length(seq_len: int, cp_size: int) -> int:
    """The chunk length ``seq_len / (2·cp)``; a clear error when it is not whole."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"context parallelism cuts the sequence (length {seq_len}) into 2 x context_parallel_size "
            f"{cp_size} = {2 * cp_size} equal chunks: the length must be divisible by {2 * cp_size}"
        )
    return seq_len // (2 * cp_size)


def context_parallel_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of ``2·cp_size``) that cp rank ``cp_rank`` holds: ``(cp_rank, 2·cp_size-1-cp_rank)``."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def context_parallel_position_ids(
    seq_len: int,
    cp_size: Optional[int] = None,
    cp_rank: Optional[int] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Global positions ``[seq_len / cp]`` of the tokens a cp rank holds, in its local order (increasing).

    ``cp_size``/``cp_rank`` default to parallel_state's. For packed documents whose positions restart,
    split the full sequence's position ids with :func:`context_parallel_split` instead."""
    size, rank = _size_rank(cp_size, cp_rank)
    if size == 1:
        return torch.arange(seq_len, device=device)
    chunk = chunk_length(seq_len, size)
    first, second = context_parallel_chunk_ids(rank, size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in (first, second)])


def context_parallel_split(
    x: torch.Tensor, dim: int = 1, cp_size: Optional[int] = None, cp_rank: Optional[int] = None
) -> torch.Tensor:
    """This cp rank's share of ``x`` along ``dim`` (the sequence): chunks ``i`` and ``2·cp-1-i`` of
    ``2·cp``, concatenated. No communication; gradients flow back to the chosen positions."""
    size, rank = _size_rank(cp_size, cp_rank)
    if size == 1:
        return x
    chunk_length(x.shape[dim], size)
    chunks = x.chunk(2 * size, dim=dim)
    first, second = context_parallel_chunk_ids(rank, size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def context_parallel_batch(
    batch: dict[str, torch.Tensor], cp_size: Optional[int] = None, cp_rank: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """This cp rank's share of a micro-batch of whole sequences (``tokens``, ``labels``, ``position_ids``,
    ``segment_ids``, ...): every tensor ``[b, s, ...]`` with the sequence length of ``tokens`` (else
    ``labels``) is split along ``s`` by :func:`context_parallel_split`; other entries pass unchanged.

    Positions are taken from the whole sequence before the split: the batch's ``position_ids`` (packed
    documents' restarts included), or ``0..s-1`` when it has none, added so that a model reads the global
    positions of its tokens. With one cp rank the batch is returned as it is."""
    size, rank = _size_rank(cp_size, cp_rank)
    if size == 1:
        return batch
    reference = batch.get("tokens", batch.get("labels"))
    if reference is None or reference.dim() < 2:
        raise ValueError("context_parallel_batch needs 'tokens' or 'labels' of shape [b, s] to know the sequence")
    b, s = reference.shape[:2]
    out = dict(batch)
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(s, device=reference.device).expand(b, s)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == s:
            out[key] = context_parallel_split(value, 1, size, rank)
    return out


def gathered_positions(local_len: int, cp_size: int, device: torch.device) -> torch.Tensor:
    """Global position of each token of the rank-ordered concatenation of every rank's share."""
    seq_len = local_len * cp_size
    return torch.cat([context_parallel_position_ids(seq_len, cp_size, r, device) for r in range(cp_size)])


def context_parallel_gather(
    x: torch.Tensor, dim: int = 1, group: Group = None, sum_grads: bool = False
) -> torch.Tensor:
    """Inverse of :func:`context_parallel_split`: every cp rank's share, back in sequence order.

    Backward keeps this rank's share of the gradient (the consumer must be replicated over the group) or,
    with ``sum_grads``, sums every rank's gradient of this rank's share (each rank's own tokens read the
    whole sequence differently: the keys its queries attend to)."""
    group, size, _ = cp_group(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    gathered = gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=sum_grads, seq_dim=dim)
    order = gathered_positions(x.shape[dim], size, x.device).argsort()
    return gathered.index_select(dim, order)
