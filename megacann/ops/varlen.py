"""Variable-length attention: packed documents (and sliding windows) without an ``[s, s]`` mask.

A packed row's documents are runs of equal ``segment_ids``. Attention between a run of queries and a run
of keys with the same id is a rectangle of dense attention (causal on the diagonal, whole for an earlier
run of the same id); every other pair of runs is skipped. Each rectangle is one
:func:`megacann.ops.attention_block` step (the flash kernel on CPU and CUDA) returning its output and
log-sum-exp; rectangles that share query rows merge by online softmax in fp32. Backward runs
:func:`megacann.ops.attention_block_backward` per rectangle with the final output and lse. Memory grows
with the documents' lengths (a kernel's scratch per rectangle) and ``O(s)`` for the output and lse,
never with ``s²``. A sliding window W cuts each rectangle into query chunks of ``max(W, MIN_CHUNK)``
rows that read only the keys within W behind them (``band`` masks inside a chunk).

Registered implementations of ``scaled_dot_product_attention`` (taken only when ``segment_ids``, a
sliding window or causal ``sinks`` are given, without ``attn_mask`` or dropout; anything else runs the
reference). Sinks rescale the merged output and lse once (:mod:`megacann.ops.attention_sinks`); the
backward then runs with those, and adds the sinks' gradient:

- ``varlen`` (cpu, cuda; priority 10): the rectangles above; on CPU, rows of at most :data:`DENSE_MAX_SEQ`
  tokens take the masked reference in one call instead (its ``[s, s]`` mask is then small: 32 rows of 24
  tokens in two documents ran 9x faster forward and backward, 16 rows of 128 tokens 1.5x, and 4 rows of
  256 tokens 0.9x: ``benchmarks/NOTES.md``, "Issue 41 (session 15)");
- ``flash_varlen`` (cuda; priority 15): ``torch.nn.attention.varlen.varlen_attn`` (flash-attention's
  varlen kernel over the documents laid out as one ``[tokens, heads, d]`` row, window included) for
  fp16/bf16 without sinks; other dtypes, and sinks, take ``varlen``.

:func:`block_attention` / :func:`block_attention_backward` are the same per-block computation with
separate query and key ids, for the context-parallel ring and all-gather.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from megacann import ops
from megacann.ops import reference
from megacann.ops.attention_blocks import acc_dtype, cuda_flash_fits, merge_block
from megacann.ops.attention_sinks import add_sinks, check_sinks, sinks_grad
from megacann.ops.npu import cumulative_seq_lens
from megacann.ops.registry import register

VARLEN, FLASH_VARLEN = "varlen", "flash_varlen"
MIN_CHUNK = 256  # query rows per chunk of a windowed rectangle, at least
# CPU rows of at most this many tokens take one masked attention call instead of the rectangles
DENSE_MAX_SEQ = 128
Runs = list[list[tuple[int, int, int]]]  # per batch row: (start, end, id) of each run of equal ids
Segments = Optional[tuple[Runs, Runs]]  # runs of the query rows, of the keys
# (batch row, query start, query end, key start, key end, causal)
Rect = tuple[int, int, int, int, int, bool]


def runs_of(segment_ids: torch.Tensor) -> Runs:
    """Per row of ``segment_ids`` ``[b, s]``: its runs of equal ids as ``(start, end, id)`` (one device read)."""
    b, s = segment_ids.shape
    starts = torch.ones(b, s, dtype=torch.bool, device=segment_ids.device)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    where = starts.nonzero()
    found = torch.cat([where, segment_ids[starts].unsqueeze(1).to(where.dtype)], 1).tolist()
    rows: Runs = [[] for _ in range(b)]
    for (row, start, ident), after in zip(found, found[1:] + [None]):
        end = after[1] if after is not None and after[0] == row else s
        rows[row].append((start, end, ident))
    return rows


def clip_runs(runs: Runs, start: int, stop: int) -> Runs:
    """The runs of tokens ``[start, stop)`` of each row, counted from ``start`` (no device read)."""
    return [
        [(max(a, start) - start, min(b, stop) - start, ident) for a, b, ident in row if a < stop and b > start]
        for row in runs
    ]


def rectangles(seg_q: torch.Tensor, seg_k: torch.Tensor, causal: bool, window: Optional[int] = None) -> list[Rect]:
    """The dense rectangles ``(row, q0, q1, k0, k1, causal)`` of attention restricted to equal ids (see
    :func:`pair_runs`)."""
    return pair_runs(runs_of(seg_q), runs_of(seg_k), causal, window)


def pair_runs(q_runs: Runs, k_runs: Runs, causal: bool, window: Optional[int] = None) -> list[Rect]:
    """The dense rectangles ``(row, q0, q1, k0, k1, causal)`` between runs of equal ids.

    ``causal`` needs the query and key runs to be those of the same tokens: a key run before the query
    run is whole, the run itself causal, a later one skipped. ``window`` W (positions = indices, causal):
    rectangles are cut into query chunks reading keys ``[q0 - W + 1, q1)`` only; they then need the band
    mask (``causal`` False in the result, see :func:`band_of`)."""
    rects: list[Rect] = []
    for row, (q_row, k_row) in enumerate(zip(q_runs, k_runs)):
        by_id: dict[int, list[tuple[int, int]]] = {}
        for start, end, ident in k_row:
            by_id.setdefault(ident, []).append((start, end))
        for q0, q1, ident in q_row:
            for k0, k1 in by_id.get(ident, ()):
                diagonal = False
                if causal:
                    if k0 >= q1:
                        continue
                    diagonal = (k0, k1) == (q0, q1)
                    if not diagonal and k1 > q0:
                        raise ValueError("causal block attention needs the query and key ids of the same tokens")
                if window is None:
                    rects.append((row, q0, q1, k0, k1, diagonal))
                    continue
                chunk = max(window, MIN_CHUNK)
                for c0 in range(q0, q1, chunk):
                    c1 = min(c0 + chunk, q1)
                    lo, hi = max(k0, c0 - window + 1), min(k1, c1)
                    if lo < hi:
                        rects.append((row, c0, c1, lo, hi, False))
    return rects


def band_of(rect: Rect, window: Optional[int], device: torch.device):
    """The ``band`` argument of a rectangle cut for a window (positions = indices), or None."""
    if window is None:
        return None
    _, q0, q1, k0, k1, _ = rect
    return torch.arange(q0, q1, device=device), torch.arange(k0, k1, device=device), window


def _slice_band(band, rect: Rect):
    if band is None:
        return None
    _, q0, q1, k0, k1, _ = rect
    return band[0][q0:q1], band[1][k0:k1], band[2]


def run_forward(q, k, v, scale: float, rects: list[Rect], bands: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``[b, hq, sq, d]`` and lse ``[b, hq, sq]`` (fp32) of BHSD ``q, k, v`` over ``rects``; rows
    no rectangle covers get 0 and -inf."""
    acc = acc_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    written: set[tuple[int, int, int]] = set()
    for (row, q0, q1, k0, k1, causal), band in zip(rects, bands):
        r = slice(row, row + 1)
        o, m = ops.attention_block(
            q[r, :, q0:q1], k[r, :, k0:k1], v[r, :, k0:k1], scale=scale, causal=causal, band=band
        )
        if (row, q0, q1) in written:
            merge_block(out[r, :, q0:q1], lse[r, :, q0:q1], o, m)
        else:
            out[r, :, q0:q1], lse[r, :, q0:q1] = o, m
            written.add((row, q0, q1))
    return out, lse


def run_backward(q, k, v, out, lse, dout, scale: float, rects: list[Rect], bands: list):
    """``(dq, dk, dv)`` (fp32) of :func:`run_forward` given the final ``out`` and ``lse``."""
    acc = acc_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    for (row, q0, q1, k0, k1, causal), band in zip(rects, bands):
        r, rows, keys = slice(row, row + 1), slice(q0, q1), slice(k0, k1)
        dq_r, dk_r, dv_r = ops.attention_block_backward(
            q[r, :, rows],
            k[r, :, keys],
            v[r, :, keys],
            out[r, :, rows],
            lse[r, :, rows],
            dout[r, :, rows],
            scale=scale,
            causal=causal,
            band=band,
        )
        dq[r, :, rows] += dq_r
        dk[r, :, keys] += dk_r
        dv[r, :, keys] += dv_r
    return dq, dk, dv


def _block_plan(causal: bool, segments: tuple[Runs, Runs], band):
    rects = pair_runs(segments[0], segments[1], causal)
    return rects, [_slice_band(band, rect) for rect in rects]


def block_attention(q, k, v, scale: float, *, causal: bool, segments: Segments = None, band=None):
    """One context-parallel step: BHSD ``q`` over ``k, v`` with packed ``segments`` (:func:`runs_of` the
    query rows, of the keys) as rectangles; without segments one :func:`megacann.ops.attention_block` call."""
    if segments is None:
        return ops.attention_block(q, k, v, scale=scale, causal=causal, band=band)
    rects, bands = _block_plan(causal, segments, band)
    return run_forward(q, k, v, scale, rects, bands)


def block_attention_backward(q, k, v, out, lse, dout, scale: float, *, causal: bool, segments: Segments, band=None):
    """Backward of :func:`block_attention` with the final ``out`` and ``lse``: ``(dq, dk, dv)`` fp32."""
    if segments is None:
        return ops.attention_block_backward(q, k, v, out, lse, dout, scale=scale, causal=causal, band=band)
    rects, bands = _block_plan(causal, segments, band)
    return run_backward(q, k, v, out, lse, dout, scale, rects, bands)


# -- one process: scaled_dot_product_attention --------------------------------------------------------------


_PLAN_CACHE: dict[str, tuple] = {}


def _plan(segment_ids: Optional[torch.Tensor], b: int, s: int, causal: bool, window: Optional[int], device):
    """Rectangles and bands of a batch; kept for the last ``segment_ids`` tensor (the layers of one model
    get the same one, so the runs are read from the device once per step)."""
    key = (b, s, causal, window, device, None if segment_ids is None else segment_ids._version)
    cached = _PLAN_CACHE.get("entry")
    if cached is not None and cached[0] == key and cached[1]() is segment_ids:
        return cached[2]
    seg = segment_ids if segment_ids is not None else torch.zeros(b, s, dtype=torch.long, device=device)
    rects = rectangles(seg, seg, causal, window)
    plan = rects, [band_of(rect, window, device) for rect in rects]
    if segment_ids is not None:
        _PLAN_CACHE["entry"] = (key, weakref.ref(segment_ids), plan)
    return plan


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segment_ids, scale, causal, window, sinks):
        plan = _plan(segment_ids, q.shape[0], q.shape[1], causal, window, q.device)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        out, lse = run_forward(qh, kh, vh, scale, *plan)
        if sinks is not None:  # the sink columns, from the plain softmax's output and lse
            out, lse = add_sinks(out, lse, sinks)
        result = out.transpose(1, 2).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, sinks)
        ctx.plan, ctx.scale = plan, scale
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, result, lse, sinks = ctx.saved_tensors
        qh, kh, vh, oh, gh = (t.transpose(1, 2) for t in (q, k, v, result, grad))
        dq, dk, dv = run_backward(qh, kh, vh, oh, lse, gh, ctx.scale, *ctx.plan)
        back = (dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype))
        dsinks = sinks_grad(oh, lse, gh, sinks) if sinks is not None and ctx.needs_input_grad[7] else None
        return (*back, None, None, None, None, dsinks)


def _takes_varlen(causal, segment_ids, attn_mask, dropout_p, window, sinks=None) -> bool:
    wanted = segment_ids is not None or window is not None or (sinks is not None and causal)
    return attn_mask is None and dropout_p == 0.0 and wanted


@register("scaled_dot_product_attention", VARLEN, priority=10, device_types=("cpu", "cuda"))
def varlen_attention(
    q, k, v, *, causal, segment_ids, attn_mask, dropout_p, scale, sliding_window, sinks=None
) -> torch.Tensor:
    window = reference.effective_window(sliding_window, q.shape[1], causal)
    if not _takes_varlen(causal, segment_ids, attn_mask, dropout_p, window, sinks):
        return reference.scaled_dot_product_attention(
            q, k, v, causal=causal, segment_ids=segment_ids, attn_mask=attn_mask, dropout_p=dropout_p,
            scale=scale, sliding_window=sliding_window, sinks=sinks,
        )  # fmt: skip
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of key/value heads {k.shape[2]}")
    check_sinks(sinks, q.shape[2])
    if q.device.type == "cpu" and max(q.shape[1], k.shape[1]) <= DENSE_MAX_SEQ:  # short rows: one masked call
        return reference.scaled_dot_product_attention(
            q, k, v, causal=causal, segment_ids=segment_ids, scale=scale, sliding_window=sliding_window, sinks=sinks
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _VarlenAttention.apply(q, k, v, segment_ids, scale, causal, window, sinks)


def _flash_varlen_available() -> bool:
    if not torch.cuda.is_available():
        return False
    from torch.nn.attention import varlen  # noqa: F401  (PyTorch >= 2.9)

    return True


@register(
    "scaled_dot_product_attention", FLASH_VARLEN, priority=15, device_types=("cuda",), available=_flash_varlen_available
)
def flash_varlen_attention(
    q, k, v, *, causal, segment_ids, attn_mask, dropout_p, scale, sliding_window, sinks=None
) -> torch.Tensor:
    window = reference.effective_window(sliding_window, q.shape[1], causal)
    fits = cuda_flash_fits(q, k, v) and sinks is None  # PyTorch's varlen kernel has no sink column
    if not (fits and _takes_varlen(causal, segment_ids, attn_mask, dropout_p, window)):
        return varlen_attention(
            q, k, v, causal=causal, segment_ids=segment_ids, attn_mask=attn_mask, dropout_p=dropout_p,
            scale=scale, sliding_window=sliding_window, sinks=sinks,
        )  # fmt: skip
    from torch.nn.attention.varlen import varlen_attn

    b, s, hq, d = q.shape
    seg = segment_ids if segment_ids is not None else torch.zeros(b, s, dtype=torch.long, device=q.device)
    ends = torch.tensor(cumulative_seq_lens(seg), dtype=torch.int32, device=q.device)
    cu = torch.cat([ends.new_zeros(1), ends])
    longest = int((cu[1:] - cu[:-1]).max())
    left = -1 if window is None else window - 1
    flat = [t.reshape(b * s, t.shape[2], d) for t in (q, k, v)]
    out = varlen_attn(
        *flat,
        cu,
        cu,
        longest,
        longest,
        scale=scale,
        window_size=(left, 0 if causal else -1),
        enable_gqa=hq != k.shape[2],
    )
    return out.view(b, s, hq, d)
