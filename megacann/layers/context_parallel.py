"""Context parallelism: the sequence split across the ranks of the context-parallel (cp) group.

**Layout.** A sequence of length ``s`` is cut into ``2·cp`` equal chunks and cp rank ``i`` holds chunks
``i`` and ``2·cp-1-i`` (Megatron-Core's load-balanced layout): with a causal mask the early chunk sees
few keys and the late one many, so every rank does the same attention work. :func:`context_parallel_split`
takes a rank's share of any ``[b, s, ...]`` tensor (tokens, labels, position ids, segment ids),
:func:`context_parallel_batch` of a whole micro-batch (what the pipeline schedules hand the model),
:func:`context_parallel_gather` puts the shares back in order, :func:`context_parallel_position_ids`
names the global positions of a rank's tokens (for rotary embeddings).

**Attention.** Every layer except attention works token by token, so only attention talks across the
group. :func:`context_parallel_attention` takes this rank's ``q, k, v`` (and ``segment_ids`` of packed
documents) in the layout above and returns this rank's output, causal, with GQA, by one of:

- ``ring``: key/value blocks travel around the ring, overlapped with computation;
- ``allgather``: keys and values are all-gathered at once, then the same blockwise computation
  (backward gathers them again and reduce-scatters their gradients);
- ``ulysses``: all-to-all trades the sequence shards for head shards, each rank attends over the whole
  sequence with ``heads/cp`` heads, and a second all-to-all trades back (DeepSpeed-Ulysses).

The first two share :mod:`megacann.layers.blockwise_attention`. See ``docs/context_parallel.md`` for when each wins.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megacann import ops
from megacann import parallel_state as ps
from megacann.layers.blockwise_attention import blockwise_attention
from megacann.layers.mappings import gather_from_sequence_parallel_region

CONTEXT_PARALLEL_ALGORITHMS = ("ring", "allgather", "ulysses")

Group = Optional[dist.ProcessGroup]


def _cp_group(group: Group) -> tuple[Group, int, int]:
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


def _check_divisible(seq_len: int, cp_size: int) -> int:
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
    chunk = _check_divisible(seq_len, size)
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
    _check_divisible(x.shape[dim], size)
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


def _gathered_positions(local_len: int, cp_size: int, device: torch.device) -> torch.Tensor:
    """Global position of each token of the rank-ordered concatenation of every rank's share."""
    seq_len = local_len * cp_size
    return torch.cat([context_parallel_position_ids(seq_len, cp_size, r, device) for r in range(cp_size)])


def context_parallel_gather(x: torch.Tensor, dim: int = 1, group: Group = None) -> torch.Tensor:
    """Inverse of :func:`context_parallel_split`: every cp rank's share, back in sequence order.

    Backward keeps this rank's share of the gradient (the consumer must be replicated over the group)."""
    group, size, _ = _cp_group(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    gathered = gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=False, seq_dim=dim)
    order = _gathered_positions(x.shape[dim], size, x.device).argsort()
    return gathered.index_select(dim, order)


# -- Ulysses: all-to-all between sequence and head shards ----------------------------------------------


def _seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[b, s, cp, m, d]`` (head block ``j`` for rank ``j``) -> ``[b, cp·s, m, d]`` (rank ``k``'s tokens
    at ``k·s``)."""
    b, s, cp, m, d = x.shape
    send = x.permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, cp * s, m, d)


def _heads_to_seq(y: torch.Tensor, group: Group) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`, as ``[b, s, cp, m, d]``."""
    cp = dist.get_world_size(group)
    b, total, m, d = y.shape
    send = y.reshape(b, cp, total // cp, m, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4)


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


def _ulysses_attention(q, k, v, segment_ids, scale, group, size):
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
    qkv = torch.cat([t.reshape(b, s, size, n, d) for t, n in zip((q, k, v), per_rank)], dim=3)
    qkv = _AllToAll.apply(qkv, group, True)  # [b, cp·s, (hq + 2·hkv) / cp, d], rank order
    positions = _gathered_positions(s, size, q.device)
    q, k, v = qkv.index_select(1, positions.argsort()).split(per_rank, dim=2)  # sequence order
    if segment_ids is not None:
        segment_ids = context_parallel_gather(segment_ids, group=group)
    out = ops.scaled_dot_product_attention(q, k, v, causal=True, segment_ids=segment_ids, scale=scale)
    out = _AllToAll.apply(out.index_select(1, positions), group, False)
    return out.reshape(b, s, hq, d)


# -- public entry ------------------------------------------------------------------------------------


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: Optional[torch.Tensor] = None,
    *,
    algo: str = "ring",
    scale: Optional[float] = None,
    group: Group = None,
) -> torch.Tensor:
    """Causal attention of this cp rank's tokens over the whole sequence of the cp group.

    ``q`` ``[b, s_local, heads, d]``, ``k``/``v`` ``[b, s_local, kv_heads, d]`` (GQA: kv head ``j`` serves
    query heads ``j·g .. j·g+g-1``) and ``segment_ids`` ``[b, s_local]`` (packed documents: attention stays
    within equal ids) hold this rank's chunks, as :func:`context_parallel_split` cuts them. Returns
    ``[b, s_local, heads, d]``. ``group`` defaults to parallel_state's cp group; with one rank this is
    plain causal attention. ``algo`` is one of :data:`CONTEXT_PARALLEL_ALGORITHMS`.
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
    group, size, _ = _cp_group(group)
    if size == 1:
        return ops.scaled_dot_product_attention(q, k, v, causal=True, segment_ids=segment_ids, scale=scale)
    _check_divisible(q.shape[1] * size, size)
    if algo == "ulysses":
        return _ulysses_attention(q, k, v, segment_ids, scale, group, size)
    return blockwise_attention(q, k, v, segment_ids, scale, group, transport=algo)
