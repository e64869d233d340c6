"""Blockwise causal attention over a context-parallel group: ring (blocks travel) or all-gather.

Each of the ``cp`` ranks holds two of the ``2·cp`` sequence chunks (chunk ``r`` and chunk ``2·cp-1-r``, see
:func:`megacann.layers.context_parallel.context_parallel_split`), as ``q, k, v`` of shape
``[b, s_local, heads, head_dim]``. A rank's queries attend to every rank's key/value block in turn,
one block per step, and with the load-balanced layout the causal mask makes every step but the rank's
own exactly half a block of work, with no mask:

    block of an earlier rank (j < r): all local queries, the block's first chunk only
    block of a later rank (j > r):    the second local chunk of queries, the whole block
    own block (j = r):                everything, causal (local order is global order)

Each step is the registered op :func:`megacann.ops.attention_block` (the reference's fp32 tiles, PyTorch's
flash attention on CPU and CUDA, ``npu_fusion_attention`` on NPU), which returns the block's output and
log-sum-exp ``lse``; partial results merge by online softmax in fp32. Backward runs
:func:`megacann.ops.attention_block_backward` per step with the saved final ``out`` and ``lse``
(flash-attention's backward) and sends each block's ``dk, dv`` (fp32) back to its owner. Packed
sequences (``segment_ids``; the ids of all ranks are all-gathered once, they are small, and their runs
read from the device once per call) split a step into the rectangles of equal ids (:func:`megacann.ops.varlen.block_attention`, the variable-length path), so
no mask is built. A sliding window W passes the global positions of the step's rows and columns as the
op's ``band`` (``0 <= query position - key position < W``), and a step whose keys all lie W or more behind
its queries is skipped (in backward it hands on a zero gradient). Attention sinks (gpt-oss) join each
query's softmax once, after the last merge (``L' = logaddexp(L, z)``, ``o' = o · exp(L - L')``,
:mod:`megacann.ops.attention_sinks`): backward runs the same steps with ``o'`` and ``L'``, and each rank's
sink gradient covers its own queries (summed over the group with the other replicated weights' gradients).

How the blocks reach a rank is the transport:

- ``ring``: at step ``t`` rank ``r`` works on the block of rank ``(r - t) mod cp`` while the block for
  step ``t + 1`` is already on its way from the previous rank (``isend``/``irecv`` posted before the
  computation). In backward the blocks travel again and each block's ``dk, dv`` accumulate as they
  travel with it, reaching the owner after ``cp`` hops.
- ``allgather``: the blocks are all-gathered at once (again in backward, so only the rank's own keys and
  values are kept between forward and backward), and the gradients of all blocks are reduce-scattered
  back to their owners at the end.

Ring transfers are single ``isend``/``irecv`` calls in a fixed order, never ``batch_isend_irecv`` (it has
hung on gloo): even ranks send to the next rank then receive from the previous one, odd ranks receive
then send, so both ends of every link post matching operations in the same order (what NCCL and HCCL
need when the ring has two ranks and both directions share one link). No tags, so gloo on CPU checks
the order a cluster will see.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Optional

import torch
import torch.distributed as dist

from megacann.layers.context_parallel.layout import context_parallel_position_ids
from megacann.layers.mappings import all_gather_flat, reduce_scatter_flat
from megacann.ops.attention_blocks import acc_dtype, merge_block
from megacann.ops.attention_sinks import add_sinks, check_sinks, sinks_grad
from megacann.ops.varlen import block_attention, block_attention_backward, clip_runs, runs_of

_NEG_INF = float("-inf")


# -- point-to-point around the ring ---------------------------------------------------------------------


class _Ring:
    """Ring transport: blocks pass from each rank to the next; gradients travel with them."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if self.size > 1:
            ranks = dist.get_process_group_ranks(group)
            self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]
        self._grad: Optional[torch.Tensor] = None
        self._grad_works: list[dist.Work] = []

    def pass_on(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[dist.Work]]:
        """Send ``tensor`` to the next rank and receive the previous rank's tensor of the same shape
        into a new buffer. Returns (buffer, pending works): wait on them before reading the buffer."""
        received = torch.empty_like(tensor)
        if self.rank % 2 == 0:
            works = [dist.isend(tensor, self.next, group=self.group), dist.irecv(received, self.prev, group=self.group)]
        else:
            works = [dist.irecv(received, self.prev, group=self.group), dist.isend(tensor, self.next, group=self.group)]
        return received, works

    def blocks(self, kv: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(source rank, its [2, b, s, kv_heads, d] block) for every rank, own first; the next block's
        transfer is posted before the current one is handed out, so it overlaps the computation."""
        for step in range(self.size):
            if step < self.size - 1:
                incoming, works = self.pass_on(kv)
            yield (self.rank - step) % self.size, kv
            if step < self.size - 1:
                _wait(works)
                kv = incoming

    def add_grad(self, source: int, grad: torch.Tensor) -> None:
        """This rank's part of block ``source``'s gradient (called in :meth:`blocks` order): added to what
        earlier ranks sent along, and passed on to the next holder (the last hop reaches the owner)."""
        if self._grad is not None:
            _wait(self._grad_works)
            grad += self._grad
        if self.size > 1:
            self._grad, self._grad_works = self.pass_on(grad)
        else:
            self._grad = grad

    def own_grad(self) -> torch.Tensor:
        """The full gradient of this rank's block, once every step has called :meth:`add_grad`."""
        _wait(self._grad_works)
        return self._grad


class _AllGather(_Ring):
    """All-gather transport: every block at once; gradients summed into all blocks, reduce-scattered."""

    def blocks(self, kv: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        kv = kv.contiguous()
        gathered = torch.empty((self.size,) + tuple(kv.shape), dtype=kv.dtype, device=kv.device)
        all_gather_flat(gathered.view(-1), kv.view(-1), self.group)
        for step in range(self.size):
            source = (self.rank - step) % self.size
            yield source, gathered[source]

    def add_grad(self, source: int, grad: torch.Tensor) -> None:
        if self._grad is None:
            self._grad = grad.new_zeros((self.size,) + tuple(grad.shape))
        self._grad[source] += grad

    def own_grad(self) -> torch.Tensor:
        own = torch.empty_like(self._grad[0])
        reduce_scatter_flat(own.view(-1), self._grad.view(-1), self.group)
        return own


TRANSPORTS = {"ring": _Ring, "allgather": _AllGather}


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


# -- per-block math: the registered block ops, merged in fp32 ------------------------------------------


def _block_forward(q, k, v, scale, segments, causal, band=None):
    """One step: BHSD query rows ``q`` over one block ``k, v``: the block-normalised output and the rows'
    log-sum-exp (fp32), by :func:`megacann.ops.attention_block` (per document rectangle when packed)."""
    return block_attention(q, k, v, scale, causal=causal, segments=segments, band=band)


def _block_backward(q, k, v, out, lse, dout, scale, segments, causal, band=None):
    """Gradients ``(dq, dk, dv)`` (fp32) of one step from the final ``out`` and ``lse``."""
    return block_attention_backward(q, k, v, out, lse, dout, scale, causal=causal, segments=segments, band=band)


def _step_plan(rank: int, source: int, chunk: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) of the work on the block of rank ``source`` (see module doc)."""
    if source == rank:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, chunk), False
    return slice(chunk, None), slice(None), False


def _band(window: Optional[int], blocks: _Ring, source: int, rows: slice, cols: slice, local: torch.Tensor):
    """(global positions of the step's query rows, of its key columns, ``window``), or None without a
    window; ``local``: a tensor of this rank's tokens along dim 1 (their number and device)."""
    if window is None:
        return None
    seq_len, device = local.shape[1] * blocks.size, local.device
    pos_q = context_parallel_position_ids(seq_len, blocks.size, blocks.rank, device)
    pos_k = context_parallel_position_ids(seq_len, blocks.size, source, device)
    return pos_q[rows], pos_k[cols], window


def _global_position(index: int, rank: int, size: int, chunk: int) -> int:
    """Global position of local token ``index`` of cp rank ``rank`` (chunks ``rank`` and ``2·size-1-rank``)."""
    return (rank if index < chunk else 2 * size - 1 - rank - 1) * chunk + index


def _out_of_window(window: Optional[int], blocks: _Ring, source: int, rows: slice, cols: slice, chunk: int) -> bool:
    """Whether every key of the step lies ``window`` or more positions behind every query (nothing is
    seen), from the layout alone (no device read)."""
    if window is None or source == blocks.rank:
        return False
    first_row = _global_position(rows.start or 0, blocks.rank, blocks.size, chunk)
    last_col = _global_position((cols.stop or 2 * chunk) - 1, source, blocks.size, chunk)
    return first_row - last_col >= window


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segment_ids, scale, group, transport, window, sinks):
        blocks = TRANSPORTS[transport](group)
        chunk = q.shape[1] // 2
        seg_all = _gather_segments(segment_ids, blocks)
        runs = _runs_by_rank(seg_all)
        qh, acc = q.transpose(1, 2), acc_dtype(q.dtype)
        out = torch.zeros(qh.shape, dtype=acc, device=q.device)
        lse = torch.full(qh.shape[:-1], _NEG_INF, dtype=acc, device=q.device)
        for source, kv in blocks.blocks(torch.stack([k, v])):
            rows, cols, causal = _step_plan(blocks.rank, source, chunk)
            if _out_of_window(window, blocks, source, rows, cols, chunk):
                continue
            band = _band(window, blocks, source, rows, cols, q)
            segments = _segments(runs, blocks.rank, source, rows, cols, chunk)
            kb, vb = (t[:, cols].transpose(1, 2) for t in kv)
            block_out, block_lse = _block_forward(qh[:, :, rows], kb, vb, scale, segments, causal, band)
            merge_block(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        if sinks is not None:  # every block merged: each query's sink column joins its softmax once, here
            out, lse = add_sinks(out, lse, sinks)
        # contiguous [b, s, heads, d]: the output projection's view of it (b s (h d)) then shares its storage
        # instead of saving a copy of its own for backward
        result = out.transpose(1, 2).to(q.dtype).contiguous()
        ctx.save_for_backward(q, k, v, result, lse, sinks)
        ctx.scale, ctx.group, ctx.transport, ctx.window, ctx.runs = scale, group, transport, window, runs
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        blocks, scale = TRANSPORTS[ctx.transport](ctx.group), ctx.scale
        chunk, acc = q.shape[1] // 2, acc_dtype(q.dtype)
        qh, oh, gh = q.transpose(1, 2), out.transpose(1, 2), grad.transpose(1, 2)
        dq = torch.zeros(qh.shape, dtype=acc, device=q.device)
        for source, kv in blocks.blocks(torch.stack([k, v])):
            rows, cols, causal = _step_plan(blocks.rank, source, chunk)
            dkv = torch.zeros((2,) + tuple(k.shape), dtype=acc, device=k.device)  # laid out like the block
            if _out_of_window(ctx.window, blocks, source, rows, cols, chunk):  # nothing seen: zeros travel on
                blocks.add_grad(source, dkv)
                continue
            band = _band(ctx.window, blocks, source, rows, cols, q)
            segments = _segments(ctx.runs, blocks.rank, source, rows, cols, chunk)
            kb, vb = (t[:, cols].transpose(1, 2) for t in kv)
            dq_b, dk_b, dv_b = _block_backward(
                qh[:, :, rows], kb, vb, oh[:, :, rows], lse[:, :, rows], gh[:, :, rows], scale, segments, causal, band
            )
            dq[:, :, rows] += dq_b
            dkv[0][:, cols] = dk_b.transpose(1, 2)
            dkv[1][:, cols] = dv_b.transpose(1, 2)
            blocks.add_grad(source, dkv)
        dkv = blocks.own_grad()
        # the sinks' gradient from this rank's queries (the caller sums it over the group, as any weight's)
        dsinks = sinks_grad(oh, lse, gh, sinks) if sinks is not None and ctx.needs_input_grad[8] else None
        grads = dq.transpose(1, 2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return (*grads, None, None, None, None, None, dsinks)


def _gather_segments(segment_ids: Optional[torch.Tensor], ring: _Ring) -> Optional[torch.Tensor]:
    """Every ring rank's ``segment_ids`` [b, s_local], stacked by rank: [cp, b, s_local] (None if None)."""
    if segment_ids is None:
        return None
    segment_ids = segment_ids.contiguous()
    if ring.size == 1:
        return segment_ids.unsqueeze(0)
    out = torch.empty((ring.size,) + tuple(segment_ids.shape), dtype=segment_ids.dtype, device=segment_ids.device)
    dist.all_gather(list(out.unbind(0)), segment_ids, group=ring.group)
    return out


def _runs_by_rank(seg_all: Optional[torch.Tensor]) -> Optional[list]:
    """The runs of equal ids of every rank's rows (``[cp][b]``), read from the device once per call."""
    if seg_all is None:
        return None
    cp, b = seg_all.shape[:2]
    flat = runs_of(seg_all.flatten(0, 1))
    return [flat[r * b : (r + 1) * b] for r in range(cp)]


def _segments(runs, rank, source, rows, cols, chunk) -> Optional[tuple]:
    """(runs of this step's query rows, of its key columns), or None without packing."""
    if runs is None:
        return None

    def bounds(part: slice) -> tuple[int, int]:
        return part.start or 0, 2 * chunk if part.stop is None else part.stop

    return clip_runs(runs[rank], *bounds(rows)), clip_runs(runs[source], *bounds(cols))


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    group: Optional[dist.ProcessGroup] = None,
    transport: str = "ring",
    sliding_window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of this rank's two sequence chunks over the whole sequence of ``group``.

    ``q`` ``[b, s_local, heads, d]``, ``k``/``v`` ``[b, s_local, kv_heads, d]`` and ``segment_ids``
    ``[b, s_local]`` are this rank's tokens in the load-balanced layout; returns ``[b, s_local, heads, d]``
    in ``q``'s dtype. ``transport``: ``ring`` or ``allgather``. ``group`` None or of one rank: plain
    (single block) attention. ``sliding_window`` W: each query sees only its last W keys of the whole
    sequence (itself included). ``sinks`` ``[heads]`` (gpt-oss): each head's sink logit joins every query's
    softmax once, after the blocks are merged; its gradient covers this rank's queries only.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r} is not one of {tuple(TRANSPORTS)}")
    if group is not None and dist.get_world_size(group) > 1 and q.shape[1] % 2:
        raise ValueError(
            f"blockwise attention needs this rank's two sequence chunks, an even local length; got {q.shape[1]}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    check_sinks(sinks, q.shape[2])
    return _BlockwiseAttention.apply(q, k, v, segment_ids, scale, group, transport, sliding_window, sinks)
