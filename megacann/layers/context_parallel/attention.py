"""Causal attention across the context-parallel group: the one entry :class:`SelfAttention` calls."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megacann import ops
from megacann.layers.context_parallel.blockwise import blockwise_attention
from megacann.layers.context_parallel.layout import chunk_length, cp_group
from megacann.layers.context_parallel.ulysses import ulysses_attention
from megacann.ops.reference import effective_window

CONTEXT_PARALLEL_ALGORITHMS = ("ring", "allgather", "ulysses")
# the algorithm whose ranks each hold the whole sequence: what layers that read all of it (DeepSeek-V3.2's
# indexer, DeepSeek-V4's compressors) run under, gathering it themselves
WHOLE_SEQUENCE_ALGO = "allgather"


def require_whole_sequence_algo(layer: str, algo: Optional[str], needs: str) -> None:
    """Refuse, naming ``layer`` and ``algo``, a context-parallel algorithm other than
    :data:`WHOLE_SEQUENCE_ALGO` for a layer that reads the whole sequence on every rank (``needs``: why)."""
    if algo != WHOLE_SEQUENCE_ALGO:
        raise ValueError(
            f"{layer} runs under context parallelism with context_parallel_algo {WHOLE_SEQUENCE_ALGO!r} only "
            f"({needs}), got {algo!r}"
        )


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: Optional[torch.Tensor] = None,
    *,
    algo: str = "ring",
    scale: Optional[float] = None,
    group: Optional[dist.ProcessGroup] = None,
    sliding_window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of this cp rank's tokens over the whole sequence of the cp group.

    ``q`` ``[b, s_local, heads, d]``, ``k``/``v`` ``[b, s_local, kv_heads, d]`` (GQA: kv head ``j`` serves
    query heads ``j·g .. j·g+g-1``) and ``segment_ids`` ``[b, s_local]`` (packed documents: attention stays
    within equal ids) hold this rank's chunks, as :func:`context_parallel_split` cuts them. Returns
    ``[b, s_local, heads, d]``. ``group`` defaults to parallel_state's cp group; with one rank this is
    plain causal attention. ``algo`` is one of :data:`CONTEXT_PARALLEL_ALGORITHMS`. ``sliding_window`` W
    (None: none) lets each query see only its last W keys of the whole sequence, itself included: every
    algorithm carries it (ring and all-gather mask each block by global positions and skip blocks wholly
    outside the window; Ulysses attends over the whole sequence). ``sinks`` ``[heads]`` (gpt-oss's attention
    sinks, :func:`megacann.ops.scaled_dot_product_attention`): every algorithm takes them (ring and all-gather
    add each query's sink once, after merging its blocks; Ulysses gives each rank the sinks of its block of
    heads); their gradient covers this rank's queries, summed over the group as any replicated weight's.
    """
    if algo not in CONTEXT_PARALLEL_ALGORITHMS:
        raise ValueError(f"context_parallel_algo {algo!r} is not one of {CONTEXT_PARALLEL_ALGORITHMS}")
    if q.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"context_parallel_attention expects q [b, s, heads, d] and k, v [b, s, kv_heads, d]; "
            f"got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of key/value heads {k.shape[2]}")
    if segment_ids is not None and tuple(segment_ids.shape) != tuple(q.shape[:2]):
        raise ValueError(
            f"segment_ids must be [b, s_local] = {list(q.shape[:2])} (this rank's tokens), "
            f"got {list(segment_ids.shape)}"
        )
    group, size, _ = cp_group(group)
    if size == 1:
        return ops.scaled_dot_product_attention(
            q, k, v, causal=True, segment_ids=segment_ids, scale=scale, sliding_window=sliding_window, sinks=sinks
        )
    chunk_length(q.shape[1] * size, size)
    window = effective_window(sliding_window, q.shape[1] * size, causal=True)
    if algo == "ulysses":
        return ulysses_attention(q, k, v, segment_ids, scale, group, size, window, sinks)
    return blockwise_attention(q, k, v, segment_ids, scale, group, transport=algo, sliding_window=window, sinks=sinks)
