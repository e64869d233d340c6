"""Ulysses attention (DeepSpeed-Ulysses): all-to-all trades sequence shards for head shards.

Each cp rank holds its share of the sequence with all of its tensor-parallel rank's heads. One all-to-all
gives every rank the whole sequence for ``heads / cp`` of the heads, plain causal attention runs there,
and a second all-to-all trades back. Keys and values travel with the queries in one exchange; when there
are fewer kv heads than cp ranks they are copied first (:func:`ulysses_kv_repeat`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from einops import rearrange

from megacann import ops
from megacann.layers.context_parallel.layout import context_parallel_gather, gathered_positions

Group = Optional[dist.ProcessGroup]


def _seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[b, s, cp, m, d]`` (head block ``j`` for rank ``j``) -> ``[b, cp·s, m, d]`` (rank ``k``'s tokens
    at ``k·s``)."""
    send = rearrange(x, "b s cp m d -> cp b s m d").contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return rearrange(recv, "cp b s m d -> b (cp s) m d")


def _heads_to_seq(y: torch.Tensor, group: Group) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`, as ``[b, s, cp, m, d]``."""
    send = rearrange(y, "b (cp s) m d -> cp b s m d", cp=dist.get_world_size(group)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return rearrange(recv, "cp b s m d -> b s cp m d")


class _AllToAll(torch.autograd.Function):
    """Sequence shards -> head shards (``to_heads``) or back; backward is the opposite exchange."""

    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        back = _heads_to_seq(grad, ctx.group) if ctx.to_heads else _seq_to_heads(grad, ctx.group)
        return back, None, None


def ulysses_kv_repeat(num_heads: int, num_kv_heads: int, cp_size: int) -> int:
    """How many copies of each kv head Ulysses sends so every cp rank gets the kv heads its query heads
    read: 1 when ``cp`` divides the kv heads, ``cp / kv_heads`` when the kv heads divide ``cp``, else
    ``heads / kv_heads`` (plain multi-head)."""
    if num_kv_heads % cp_size == 0:
        return 1
    if cp_size % num_kv_heads == 0:
        return cp_size // num_kv_heads
    return num_heads // num_kv_heads


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: Optional[torch.Tensor],
    scale: Optional[float],
    group: Group,
    size: int,
    sliding_window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of this rank's ``q [b, s, heads, d]``, ``k, v [b, s, kv_heads, d]`` over the
    ``size`` ranks of ``group``, by two all-to-alls; returns ``[b, s, heads, d]``. Each rank attends over
    the whole sequence in order, so a ``sliding_window`` is the one-process window; with ``sinks``
    ``[heads]`` each rank takes the sinks of the block of heads it attends with."""
    b, s, hq, d = q.shape
    if hq % size:
        raise ValueError(
            f"context_parallel_algo 'ulysses' splits this rank's {hq} attention heads across "
            f"context_parallel_size {size}: they must divide; use 'ring' or 'allgather' instead"
        )
    repeat = ulysses_kv_repeat(hq, k.shape[2], size)
    if repeat > 1:  # fewer kv heads than cp ranks: replicate them (autograd sums the copies' gradients)
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    hkv = k.shape[2]
    per_rank = [hq // size, hkv // size, hkv // size]
    # each rank's block of heads of q, k and v side by side: [b, s, cp, (hq + 2·hkv) / cp, d]
    qkv = torch.cat([rearrange(t, "b s (cp n) d -> b s cp n d", cp=size) for t in (q, k, v)], dim=3)
    qkv = _AllToAll.apply(qkv, group, True)  # [b, cp·s, (hq + 2·hkv) / cp, d], rank order
    positions = gathered_positions(s, size, q.device)
    q, k, v = qkv.index_select(1, positions.argsort()).split(per_rank, dim=2)  # sequence order
    if segment_ids is not None:
        segment_ids = context_parallel_gather(segment_ids, group=group)
    if sinks is not None:  # this rank's block of heads (the all-to-all hands rank r block r)
        per_head_block = hq // size
        first = dist.get_rank(group) * per_head_block
        sinks = sinks[first : first + per_head_block]
    out = ops.scaled_dot_product_attention(
        q, k, v, causal=True, segment_ids=segment_ids, scale=scale, sliding_window=sliding_window, sinks=sinks
    )
    out = _AllToAll.apply(out.index_select(1, positions), group, False)
    return rearrange(out, "b s cp m d -> b s (cp m) d")
