"""Blockwise causal attention over a context-parallel group: ring (blocks travel) or all-gather.

Each of the ``cp`` ranks holds two of the ``2·cp`` sequence chunks (chunk ``r`` and chunk ``2·cp-1-r``, see
:func:`megacann.layers.context_parallel.context_parallel_split`), as ``q, k, v`` of shape
``[b, s_local, heads, head_dim]``. A rank's queries attend to every rank's key/value block in turn,
one block per step, and with the load-balanced layout the causal mask makes every step but the rank's
own exactly half a block of work, with no mask:

    block of an earlier rank (j < r): all local queries, the block's first chunk only
    block of a later rank (j > r):    the second local chunk of queries, the whole block
    own block (j = r):                everything, causal (local order is global order)

Partial results merge by online softmax in fp32: ``out`` and the log-sum-exp ``lse`` of each query row.
Backward recomputes each block's scores from the saved ``out`` and ``lse`` (flash-attention's backward)
and sends each block's ``dk, dv`` (fp32) back to its owner. Scores are computed a tile of query rows at a
time (``SCORE_TILE_ELEMENTS``) with the tile's mask built on the spot, so no block-sized score or mask
matrix is held. Packed sequences add ``segment_ids`` equality to the masks (the ids of all ranks are
all-gathered once, they are small). A sliding window W adds ``query position - key position < W`` on the
global positions of the step's rows and columns, and a step whose keys all lie W or more behind its
queries is skipped (in backward it hands on a zero gradient). GQA needs no copies: queries are viewed as
``[b, kv_heads, group, s, d]`` and broadcast against their kv head.

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
from einops import rearrange

from megacann.layers.context_parallel.layout import context_parallel_position_ids
from megacann.layers.mappings import all_gather_flat, reduce_scatter_flat

_NEG_INF = float("-inf")
SCORE_TILE_ELEMENTS = 1 << 22  # most score-matrix elements computed at once (16 MiB in fp32)


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


# -- per-block math (fp32) --------------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks are computed and accumulated in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, s, heads, d]`` -> fp32 ``[b, kv_heads, heads/kv_heads, s, d]`` (a kv head's queries together)."""
    return rearrange(x.to(_acc_dtype(x.dtype)), "b s (hkv g) d -> b hkv g s d", hkv=kv_heads)


def _ungrouped(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_grouped`: ``[b, kv_heads, g, s, d]`` -> ``[b, s, kv_heads*g, d]`` in ``dtype``."""
    return rearrange(x, "b hkv g s d -> b s (hkv g) d").to(dtype)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows that see no key of this block) replaced by 0, so ``exp(score - lse)`` is 0
    there instead of NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _scores(q, k, scale, mask):
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    return scores if mask is None else scores.masked_fill_(~mask, _NEG_INF)


def _probs(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(scores - lse)`` in place (masked entries become 0)."""
    return scores.sub_(_finite(lse).unsqueeze(-1)).exp_()


def _tiles(q: torch.Tensor, keys: int, causal: bool):
    """Row tiles ``(first, end, key_end)`` of a block: as many query rows at a time as keep a tile's
    scores within ``SCORE_TILE_ELEMENTS``, so no block-sized score matrix is ever held; under the local
    causal mask a tile needs keys ``[0, end)`` only."""
    rows = q.shape[-2]
    per_row = q.numel() // (rows * q.shape[-1]) * keys  # score elements of one query row (all heads)
    step = max(1, SCORE_TILE_ELEMENTS // max(1, per_row))
    for first in range(0, rows, step):
        end = min(first + step, rows)
        yield first, end, (end if causal else None)


def _tile_mask(segments, causal, first, end, key_end, device, band=None) -> Optional[torch.Tensor]:
    """Mask of query rows ``[first, end)`` over keys ``[0, key_end)`` (True = attend), broadcastable to
    [b, hkv, g, rows, keys], or None: equal segment ids (``segments`` = (ids of the rows, of the keys)),
    when ``causal`` key index <= row index, and with a ``band`` (global positions of the rows, of the
    keys, window W) keys less than W positions behind. Built per tile, so no block-sized mask is held."""
    mask = None
    if segments is not None:
        seg_q, seg_k = segments
        mask = (seg_q[:, first:end, None] == seg_k[:, None, :key_end])[:, None, None]
    if causal:
        tri = torch.arange(first, end, device=device)[:, None] >= torch.arange(end, device=device)[None, :]
        mask = tri if mask is None else mask & tri
    if band is not None:
        pos_q, pos_k, window = band
        near = (pos_q[first:end, None] - pos_k[None, :key_end]) < window
        mask = near if mask is None else mask & near
    return mask


def _block_forward(q, k, v, scale, segments, causal, band=None):
    """Attention of query rows ``q`` [b, hkv, g, sq, d] to one block ``k, v`` [b, hkv, 1, sk, d]: the
    block-normalised output and the rows' log-sum-exp over the block."""
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
    for first, end, key_end in _tiles(q, k.shape[-2], causal):
        tile_mask = _tile_mask(segments, causal, first, end, key_end, q.device, band)
        scores = _scores(q[..., first:end, :], k[..., :key_end, :], scale, tile_mask)
        tile_lse = torch.logsumexp(scores, dim=-1)
        out[..., first:end, :] = torch.matmul(_probs(scores, tile_lse), v[..., :key_end, :])
        lse[..., first:end] = tile_lse
    return out, lse


def _merge(out, lse, block_out, block_lse) -> None:
    """Online softmax: fold a block's (output, lse) into the running ones, in place."""
    total = torch.logaddexp(lse, block_lse)
    safe = _finite(total)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(total)


def _block_backward(q, k, v, scale, segments, causal, lse, dout, delta, band=None):
    """Gradients of one block from the final ``lse`` and ``delta = rowsum(dout * out)``: (dq, dk, dv)."""
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for first, end, key_end in _tiles(q, k.shape[-2], causal):
        rows, keys = slice(first, end), slice(None, key_end)
        tile_mask = _tile_mask(segments, causal, first, end, key_end, q.device, band)
        q_t, k_t, v_t, dout_t = q[..., rows, :], k[..., keys, :], v[..., keys, :], dout[..., rows, :]
        probs = _probs(_scores(q_t, k_t, scale, tile_mask), lse[..., rows])
        dv[..., keys, :] += torch.matmul(probs.transpose(-1, -2), dout_t).sum(2, keepdim=True)
        dscores = torch.matmul(dout_t, v_t.transpose(-1, -2)).sub_(delta[..., rows].unsqueeze(-1)).mul_(probs)
        dq[..., rows, :] = torch.matmul(dscores, k_t) * scale
        dk[..., keys, :] += torch.matmul(dscores.transpose(-1, -2), q_t).sum(2, keepdim=True) * scale
    return dq, dk, dv


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
    def forward(ctx, q, k, v, segment_ids, scale, group, transport, window):
        blocks = TRANSPORTS[transport](group)
        hkv, chunk = k.shape[2], q.shape[1] // 2
        seg_all = _gather_segments(segment_ids, blocks)
        qg = _grouped(q, hkv)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], _NEG_INF, dtype=qg.dtype, device=q.device)
        for source, kv in blocks.blocks(torch.stack([k, v])):
            rows, cols, causal = _step_plan(blocks.rank, source, chunk)
            if _out_of_window(window, blocks, source, rows, cols, chunk):
                continue
            band = _band(window, blocks, source, rows, cols, q)
            segments = _segments(seg_all, blocks.rank, source, rows, cols)
            kb, vb = (_grouped(t, hkv)[:, :, :, cols] for t in kv)
            block_out, block_lse = _block_forward(qg[:, :, :, rows], kb, vb, scale, segments, causal, band)
            _merge(out[:, :, :, rows], lse[:, :, :, rows], block_out, block_lse)
        result = _ungrouped(out, q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, seg_all)
        ctx.scale, ctx.group, ctx.transport, ctx.window = scale, group, transport, window
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, seg_all = ctx.saved_tensors
        blocks, scale = TRANSPORTS[ctx.transport](ctx.group), ctx.scale
        hkv, chunk = k.shape[2], q.shape[1] // 2
        qg, dout = _grouped(q, hkv), _grouped(grad, hkv)
        delta = (dout * _grouped(out, hkv)).sum(-1)
        dq = torch.zeros_like(qg)
        for source, kv in blocks.blocks(torch.stack([k, v])):
            rows, cols, causal = _step_plan(blocks.rank, source, chunk)
            dkv = torch.zeros((2,) + tuple(k.shape), dtype=qg.dtype, device=k.device)  # laid out like the block
            if _out_of_window(ctx.window, blocks, source, rows, cols, chunk):  # nothing seen: zeros travel on
                blocks.add_grad(source, dkv)
                continue
            band = _band(ctx.window, blocks, source, rows, cols, q)
            segments = _segments(seg_all, blocks.rank, source, rows, cols)
            kb, vb = (_grouped(t, hkv)[:, :, :, cols] for t in kv)
            dq_b, dk_b, dv_b = _block_backward(
                qg[:, :, :, rows],
                kb,
                vb,
                scale,
                segments,
                causal,
                lse[:, :, :, rows],
                dout[:, :, :, rows],
                delta[:, :, :, rows],
                band,
            )
            dq[:, :, :, rows] += dq_b
            dkv[0][:, cols] = rearrange(dk_b, "b hkv 1 s d -> b s hkv d")
            dkv[1][:, cols] = rearrange(dv_b, "b hkv 1 s d -> b s hkv d")
            blocks.add_grad(source, dkv)
        dkv = blocks.own_grad()
        return _ungrouped(dq, q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


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


def _segments(seg_all, rank, source, rows, cols) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(segment ids of this step's query rows, of its key columns), or None without packing."""
    if seg_all is None:
        return None
    return seg_all[rank][:, rows], seg_all[source][:, cols]


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    group: Optional[dist.ProcessGroup] = None,
    transport: str = "ring",
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of this rank's two sequence chunks over the whole sequence of ``group``.

    ``q`` ``[b, s_local, heads, d]``, ``k``/``v`` ``[b, s_local, kv_heads, d]`` and ``segment_ids``
    ``[b, s_local]`` are this rank's tokens in the load-balanced layout; returns ``[b, s_local, heads, d]``
    in ``q``'s dtype. ``transport``: ``ring`` or ``allgather``. ``group`` None or of one rank: plain
    (single block) attention. ``sliding_window`` W: each query sees only its last W keys of the whole
    sequence (itself included).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r} is not one of {tuple(TRANSPORTS)}")
    if group is not None and dist.get_world_size(group) > 1 and q.shape[1] % 2:
        raise ValueError(
            f"blockwise attention needs this rank's two sequence chunks, an even local length; got {q.shape[1]}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _BlockwiseAttention.apply(q, k, v, segment_ids, scale, group, transport, sliding_window)
