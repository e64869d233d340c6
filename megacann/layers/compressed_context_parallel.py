"""DeepSeek-V4's attention (:class:`~megacann.layers.compressed_attention.CompressedSparseAttention`) under
context parallelism, by all-gather.

Each cp rank holds two chunks of the load-balanced layout (:mod:`megacann.layers.context_parallel`). The
compressors pool windows of consecutive tokens and a query's sliding window reaches back past its chunk, so
every rank all-gathers, in sequence order, the rotated shared KV head of every token and the hidden states
feeding the compressor and the indexer; it compresses the whole sequence itself and attends for its own
queries only, by their global token indices: the window, the compressed entries whose window has closed,
and (compressed sparse attention) the indexer's top-k among them, exactly as one process would. The
gathered tensors' gradients are summed back to the ranks that own those tokens (reduce-scatter). Ring and
Ulysses are refused by name: neither holds the whole sequence the compressors pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megacann import ops
from megacann.layers.context_parallel import (
    WHOLE_SEQUENCE_ALGO,
    context_parallel_chunk_ids,
    context_parallel_gather,
    require_whole_sequence_algo,
)
from megacann.layers.window_compressor import WindowCompressor

if TYPE_CHECKING:
    from megacann.layers.compressed_attention import CompressedSparseAttention

COMPRESSED_CONTEXT_PARALLEL_ALGO = WHOLE_SEQUENCE_ALGO  # the one algorithm DeepSeek-V4's attention runs under


def windowed_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    start: int,
    window: int,
    sinks: torch.Tensor,
    entries: Optional[torch.Tensor] = None,
    entries_read: Optional[torch.Tensor] = None,
    segment_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of queries ``q`` ``[b, n, heads, d]`` at token indices ``start .. start + n - 1`` over the
    keys/values ``kv`` ``[b, S, 1, d]`` (token 0 first) in each query's window of ``window`` tokens, plus the
    compressed ``entries`` ``[b, T, 1, d]`` where ``entries_read`` ``[b, 1, n, T]`` is True, and within the
    query's document (``segment_ids`` ``[b, S]``) when given. One block of ``window`` queries at a time: a
    block reads only the keys its window reaches, so no ``[n, S]`` score matrix is formed."""
    b, n = q.shape[:2]
    positions, outputs = torch.arange(start + n, device=q.device), []
    attend = dict(causal=False, scale=q.shape[-1] ** -0.5, sinks=sinks)
    for lo in range(start, start + n, window):
        hi, first = min(lo + window, start + n), max(0, lo - window + 1)
        queries, keys = positions[lo:hi].unsqueeze(-1), positions[first:hi]
        read = ((keys <= queries) & (keys > queries - window)).expand(b, 1, -1, -1)  # [b, 1, block, keys]
        if segment_ids is not None:
            read = read & (segment_ids[:, lo:hi, None] == segment_ids[:, None, first:hi]).unsqueeze(1)
        block = kv[:, first:hi]
        if entries is not None:
            read = torch.cat([read, entries_read[:, :, lo - start : hi - start]], dim=-1)
            block = torch.cat([block, entries], dim=1)
        outputs.append(
            ops.scaled_dot_product_attention(q[:, lo - start : hi - start], block, block, attn_mask=read, **attend)
        )
    return torch.cat(outputs, dim=1)


def check_context_parallel_algo(layer: str, algo: Optional[str]) -> None:
    """Refuse, naming it, a context-parallel algorithm other than all-gather."""
    where = f"CompressedSparseAttention ({layer}): DeepSeek-V4 attention"
    require_whole_sequence_algo(where, algo, "its compressors pool windows of the whole sequence")


def context_parallel_compressed_attention(
    attention: CompressedSparseAttention,
    q: torch.Tensor,
    kv: torch.Tensor,
    x: torch.Tensor,
    q_residual: torch.Tensor,
    position_ids: torch.Tensor,
    segment_ids: Optional[torch.Tensor],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """``[b, s_local, local heads, d]``: this rank's queries (its two chunks) over the gathered sequence's
    window keys and compressed entries; ``kv``, ``x``, ``q_residual``, ``position_ids`` and ``segment_ids``
    are this rank's shares (``position_ids`` global)."""
    check_context_parallel_algo(attention.layer_type, attention.context_parallel_algo)
    whole_kv = context_parallel_gather(kv, 1, group, sum_grads=True)
    segments = None if segment_ids is None else context_parallel_gather(segment_ids, 1, group)
    entries = entries_read = None
    if attention.compressor is not None:
        whole_x = context_parallel_gather(x, 1, group, sum_grads=True)
        entries = attention.compressor(whole_x, attention.rotary).unsqueeze(2)  # [b, T, 1, d]
        index_keys = None
        if attention.compressor.overlap:  # the indexer's own compressed keys, of the whole sequence
            with torch.no_grad():  # they only rank entries: no gradient reaches them
                index_keys = WindowCompressor.forward(attention.compressor.indexer, whole_x, attention.rotary)
        entries_read = attention.entries_read(entries.shape[1], x, q_residual, position_ids, index_keys)
    chunk, window, outputs = q.shape[1] // 2, attention.sliding_window, []
    for half, chunk_id in enumerate(context_parallel_chunk_ids(dist.get_rank(group), dist.get_world_size(group))):
        mine = slice(half * chunk, (half + 1) * chunk)  # this chunk's queries, at token indices from chunk_id·chunk
        read = None if entries_read is None else entries_read[:, :, mine]
        attend = dict(entries=entries, entries_read=read, segment_ids=segments)
        outputs.append(windowed_attention(q[:, mine], whole_kv, chunk_id * chunk, window, attention.sinks, **attend))
    return torch.cat(outputs, dim=1)


__all__ = [
    "COMPRESSED_CONTEXT_PARALLEL_ALGO",
    "check_context_parallel_algo",
    "context_parallel_compressed_attention",
    "windowed_attention",
]
