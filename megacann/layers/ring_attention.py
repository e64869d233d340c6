"""Ring attention: causal attention over a context-parallel group whose keys and values travel the ring.

Each of the ``cp`` ranks holds two of the ``2·cp`` sequence chunks (chunk ``r`` and chunk ``2·cp-1-r``, see
:func:`megacann.layers.context_parallel.context_parallel_split`), as ``q, k, v`` of shape
``[b, s_local, heads, head_dim]``. In ``cp`` steps every rank sees every rank's key/value block: at step
``t`` rank ``r`` attends to the block of rank ``(r - t) mod cp`` while the block for step ``t + 1`` is
already on its way from the previous rank (``isend``/``irecv`` posted before the computation). With the
load-balanced layout the causal mask makes each off-diagonal step exactly half a block of work:

    block of an earlier rank (j < r): all local queries, the block's first chunk only, no mask
    block of a later rank (j > r):    the second local chunk of queries, the whole block, no mask
    own block (j = r):                everything, causal (local order is global order)

Partial results merge by online softmax in fp32: ``out`` and the log-sum-exp ``lse`` of each query row.
Backward runs the ring again (flash-attention's backward per block, from the saved ``out`` and ``lse``);
each block's ``dk, dv`` accumulate in fp32 as they travel with the block and arrive back at the owner
after ``cp`` hops. Packed sequences add ``segment_ids`` equality to every block's mask (the ids of all
ranks are all-gathered once, they are small). GQA needs no copies: queries are viewed as
``[b, kv_heads, group, s, d]`` and broadcast against their kv head.

Transfers are single ``isend``/``irecv`` calls in a fixed order, never ``batch_isend_irecv`` (it has
hung on gloo): even ranks send to the next rank then receive from the previous one, odd ranks receive
then send, so both ends of every link post matching operations in the same order (what NCCL and HCCL
need when the ring has two ranks and both directions share one link). No tags, so gloo on CPU checks
the order a cluster will see.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

_NEG_INF = float("-inf")
SCORE_TILE_ELEMENTS = 1 << 22  # most score-matrix elements computed at once (16 MiB in fp32)


# -- point-to-point around the ring ---------------------------------------------------------------------


class _Ring:
    """This rank's place in the context-parallel ring: its rank, size and global neighbour ranks."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if self.size > 1:
            ranks = dist.get_process_group_ranks(group)
            self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def pass_on(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[dist.Work]]:
        """Send ``tensor`` to the next rank and receive the previous rank's tensor of the same shape
        into a new buffer. Returns (buffer, pending works): wait on them before reading the buffer."""
        received = torch.empty_like(tensor)
        if self.rank % 2 == 0:
            works = [dist.isend(tensor, self.next, group=self.group), dist.irecv(received, self.prev, group=self.group)]
        else:
            works = [dist.irecv(received, self.prev, group=self.group), dist.isend(tensor, self.next, group=self.group)]
        return received, works


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


# -- per-block math (fp32) --------------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks are computed and accumulated in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, s, heads, d]`` -> fp32 ``[b, kv_heads, heads/kv_heads, s, d]`` (a kv head's queries together)."""
    b, s, h, d = x.shape
    return x.to(_acc_dtype(x.dtype)).view(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)


def _ungrouped(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_grouped`: ``[b, kv_heads, g, s, d]`` -> ``[b, s, kv_heads*g, d]`` in ``dtype``."""
    b, hkv, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, hkv * g, d).to(dtype)


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


def _tile_mask(segments, causal, first, end, key_end, device) -> Optional[torch.Tensor]:
    """Mask of query rows ``[first, end)`` over keys ``[0, key_end)`` (True = attend), broadcastable to
    [b, hkv, g, rows, keys], or None: equal segment ids (``segments`` = (ids of the rows, of the keys))
    and, when ``causal``, key index <= row index. Built per tile, so no block-sized mask is ever held."""
    mask = None
    if segments is not None:
        seg_q, seg_k = segments
        mask = (seg_q[:, first:end, None] == seg_k[:, None, :key_end])[:, None, None]
    if causal:
        tri = torch.arange(first, end, device=device)[:, None] >= torch.arange(end, device=device)[None, :]
        mask = tri if mask is None else mask & tri
    return mask


def _block_forward(q, k, v, scale, segments, causal):
    """Attention of query rows ``q`` [b, hkv, g, sq, d] to one block ``k, v`` [b, hkv, 1, sk, d]: the
    block-normalised output and the rows' log-sum-exp over the block."""
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
    for first, end, key_end in _tiles(q, k.shape[-2], causal):
        tile_mask = _tile_mask(segments, causal, first, end, key_end, q.device)
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


def _block_backward(q, k, v, scale, segments, causal, lse, dout, delta):
    """Gradients of one block from the final ``lse`` and ``delta = rowsum(dout * out)``: (dq, dk, dv)."""
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for first, end, key_end in _tiles(q, k.shape[-2], causal):
        rows, keys = slice(first, end), slice(None, key_end)
        tile_mask = _tile_mask(segments, causal, first, end, key_end, q.device)
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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segment_ids, scale, group):
        ring = _Ring(group)
        hkv, s_local = k.shape[2], q.shape[1]
        chunk = s_local // 2
        seg_all = _gather_segments(segment_ids, ring)
        qg = _grouped(q, hkv)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], _NEG_INF, dtype=qg.dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            if step < ring.size - 1:
                incoming, works = ring.pass_on(kv)  # the next block travels while this one is computed
            rows, cols, causal = _step_plan(ring.rank, source, chunk)
            segments = _segments(seg_all, ring.rank, source, rows, cols)
            kb, vb = (_grouped(t, hkv)[:, :, :, cols] for t in kv)
            block_out, block_lse = _block_forward(qg[:, :, :, rows], kb, vb, scale, segments, causal)
            _merge(out[:, :, :, rows], lse[:, :, :, rows], block_out, block_lse)
            if step < ring.size - 1:
                _wait(works)
                kv = incoming
        result = _ungrouped(out, q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, seg_all)
        ctx.scale, ctx.group = scale, group
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, seg_all = ctx.saved_tensors
        ring, scale = _Ring(ctx.group), ctx.scale
        hkv, chunk = k.shape[2], q.shape[1] // 2
        qg, dout = _grouped(q, hkv), _grouped(grad, hkv)
        delta = (dout * _grouped(out, hkv)).sum(-1)
        dq = torch.zeros_like(qg)
        kv = torch.stack([k, v]).contiguous()
        dkv_works: list[dist.Work] = []
        dkv_incoming = None
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            if step < ring.size - 1:
                incoming, kv_works = ring.pass_on(kv)
            rows, cols, causal = _step_plan(ring.rank, source, chunk)
            segments = _segments(seg_all, ring.rank, source, rows, cols)
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
            )
            dq[:, :, :, rows] += dq_b
            # this block's dk, dv in fp32, laid out like the block ([2, b, s, hkv, d]), plus what earlier
            # ranks of the ring added to it
            dkv = torch.zeros((2,) + tuple(k.shape), dtype=qg.dtype, device=k.device)
            dkv[0][:, cols] = dk_b.squeeze(2).transpose(1, 2)
            dkv[1][:, cols] = dv_b.squeeze(2).transpose(1, 2)
            if dkv_incoming is not None:
                _wait(dkv_works)
                dkv += dkv_incoming
            if ring.size > 1:
                dkv_incoming, dkv_works = ring.pass_on(dkv)  # on to the next holder; the last hop reaches the owner
            if step < ring.size - 1:
                _wait(kv_works)
                kv = incoming
        if ring.size > 1:
            _wait(dkv_works)
            dkv = dkv_incoming
        return _ungrouped(dq, q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


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


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Causal attention of this rank's two sequence chunks over the whole sequence of the ring ``group``.

    ``q`` ``[b, s_local, heads, d]``, ``k``/``v`` ``[b, s_local, kv_heads, d]`` and ``segment_ids``
    ``[b, s_local]`` are this rank's tokens in the load-balanced layout; returns ``[b, s_local, heads, d]``
    in ``q``'s dtype. ``group`` None or of one rank: plain (single block) attention.
    """
    if group is not None and dist.get_world_size(group) > 1 and q.shape[1] % 2:
        raise ValueError(
            f"ring attention needs this rank's two sequence chunks, an even local length; got {q.shape[1]}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, segment_ids, scale, group)
