"""Implementations of the block attention ops (``attention_block`` / ``attention_block_backward``, declared
in :mod:`megacann.ops.signatures`): one block of queries over one block of keys, returning the output and
its log-sum-exp, and the flash-attention backward of such a block given the final output and lse.
Context-parallel rings (:mod:`megacann.layers.context_parallel.blockwise`) and variable-length attention
(:mod:`megacann.ops.varlen`) are built from these steps, merged in fp32 by :func:`merge_block`.

- ``reference`` (any device): PyTorch in fp32, a tile of query rows at a time (``SCORE_TILE_ELEMENTS``)
  with the tile's mask built on the spot, so no block-sized score or mask matrix is held.
- ``flash`` (cpu): PyTorch's flash attention for CPU (``aten._scaled_dot_product_flash_attention_for_cpu``
  and its backward), which returns the lse; a ``band`` goes to the reference.
- ``cuda_flash`` (cuda): PyTorch's CUDA flash attention (``aten._scaled_dot_product_flash_attention``) for
  fp16/bf16 blocks; fp32 blocks and ``band`` go to the reference.
- ``npu`` (:mod:`megacann.ops.npu`): ``npu_fusion_attention`` and its grad.

Layout is BHSD (``[b, heads, s, d]``); GQA needs no copies in the reference (queries are viewed as
``[b, kv_heads, group, s, d]``); the flash kernels get kv heads repeated (their gradients summed back).
"""

from __future__ import annotations

from typing import Optional

import torch

from megacann.ops.registry import REFERENCE, register

FLASH, CUDA_FLASH = "flash", "cuda_flash"
FLASH_PRIORITY = 10
_NEG_INF = float("-inf")
SCORE_TILE_ELEMENTS = 1 << 22  # most score-matrix elements computed at once (16 MiB in fp32)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks are computed and accumulated in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows that see no key) replaced by 0, so ``exp(score - lse)`` is 0, not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online softmax: fold a block's (output ``[..., s, d]``, lse ``[..., s]``) into the running ones, in
    place (fp32)."""
    total = torch.logaddexp(lse, block_lse)
    safe = finite(total)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(total)


# -- reference: fp32 tiles ------------------------------------------------------------------------------


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, h, s, d]`` -> accumulation-dtype ``[b, kv_heads, h/kv_heads, s, d]`` (a view when possible)."""
    return x.to(acc_dtype(x.dtype)).unflatten(1, (kv_heads, x.shape[1] // kv_heads))


def _tiles(q: torch.Tensor, keys: int, causal: bool):
    """Row tiles ``(first, end, key_end)``: as many query rows at a time as keep a tile's scores within
    ``SCORE_TILE_ELEMENTS``; under the causal mask a tile needs keys ``[0, end)`` only."""
    rows = q.shape[-2]
    per_row = q.numel() // (rows * q.shape[-1]) * keys  # score elements of one query row (all heads)
    step = max(1, SCORE_TILE_ELEMENTS // max(1, per_row))
    for first in range(0, rows, step):
        end = min(first + step, rows)
        yield first, end, (end if causal else None)


def _tile_mask(causal, first, end, key_end, device, band=None) -> Optional[torch.Tensor]:
    """Mask (True = attend) of query rows ``[first, end)`` over keys ``[0, key_end)``, or None: key index
    <= row index when ``causal``; ``0 <= row position - key position < W`` with a ``band``."""
    mask = None
    if causal:
        mask = torch.arange(first, end, device=device)[:, None] >= torch.arange(end, device=device)[None, :]
    if band is not None:
        pos_q, pos_k, window = band
        diff = pos_q[first:end, None] - pos_k[None, :key_end]
        near = (diff >= 0) & (diff < window)
        mask = near if mask is None else mask & near
    return mask


def _scores(q, k, scale, mask):
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    return scores if mask is None else scores.masked_fill_(~mask, _NEG_INF)


def _probs(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(scores - lse)`` in place (masked entries become 0)."""
    return scores.sub_(finite(lse).unsqueeze(-1)).exp_()


@register("attention_block", REFERENCE)
def attention_block(q, k, v, *, scale, causal=False, band=None) -> tuple[torch.Tensor, torch.Tensor]:
    hkv = k.shape[1]
    qg, kg, vg = _grouped(q, hkv), _grouped(k, hkv), _grouped(v, hkv)
    out, lse = torch.empty_like(qg), qg.new_empty(qg.shape[:-1])
    for first, end, key_end in _tiles(qg, kg.shape[-2], causal):
        mask = _tile_mask(causal, first, end, key_end, q.device, band)
        scores = _scores(qg[..., first:end, :], kg[..., :key_end, :], scale, mask)
        tile_lse = torch.logsumexp(scores, dim=-1)
        out[..., first:end, :] = torch.matmul(_probs(scores, tile_lse), vg[..., :key_end, :])
        lse[..., first:end] = tile_lse
    return out.flatten(1, 2), lse.flatten(1, 2)


@register("attention_block_backward", REFERENCE)
def attention_block_backward(
    q, k, v, out, lse, dout, *, scale, causal=False, band=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hkv = k.shape[1]
    qg, kg, vg, doutg = _grouped(q, hkv), _grouped(k, hkv), _grouped(v, hkv), _grouped(dout, hkv)
    lse = lse.to(qg.dtype).unflatten(1, qg.shape[1:3])
    delta = (doutg * _grouped(out, hkv)).sum(-1)
    dq, dk, dv = torch.empty_like(qg), torch.zeros_like(kg), torch.zeros_like(vg)
    for first, end, key_end in _tiles(qg, kg.shape[-2], causal):
        rows, keys = slice(first, end), slice(None, key_end)
        mask = _tile_mask(causal, first, end, key_end, q.device, band)
        q_t, k_t, v_t, dout_t = qg[..., rows, :], kg[..., keys, :], vg[..., keys, :], doutg[..., rows, :]
        probs = _probs(_scores(q_t, k_t, scale, mask), lse[..., rows])
        dv[..., keys, :] += torch.matmul(probs.transpose(-1, -2), dout_t).sum(2, keepdim=True)
        dscores = torch.matmul(dout_t, v_t.transpose(-1, -2)).sub_(delta[..., rows].unsqueeze(-1)).mul_(probs)
        dq[..., rows, :] = torch.matmul(dscores, k_t) * scale
        dk[..., keys, :] += torch.matmul(dscores.transpose(-1, -2), q_t).sum(2, keepdim=True) * scale
    return dq.flatten(1, 2), dk.flatten(1, 2), dv.flatten(1, 2)


# -- flash kernels (cpu, cuda) --------------------------------------------------------------------------


def repeat_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, hkv, s, d]`` with each kv head repeated for its ``heads / hkv`` query heads."""
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def sum_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Inverse of :func:`repeat_kv` for gradients: the copies of each kv head summed."""
    if grad.shape[1] == kv_heads:
        return grad
    return grad.unflatten(1, (kv_heads, grad.shape[1] // kv_heads)).sum(2)


def _same_dtype(*tensors: torch.Tensor) -> bool:
    return len({t.dtype for t in tensors}) == 1


def _cpu_flash_available() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


@register("attention_block", FLASH, priority=FLASH_PRIORITY, device_types=("cpu",), available=_cpu_flash_available)
def cpu_flash_attention_block(q, k, v, *, scale, causal=False, band=None) -> tuple[torch.Tensor, torch.Tensor]:
    if band is not None or not _same_dtype(q, k, v) or q.dtype == torch.float64:
        return attention_block(q, k, v, scale=scale, causal=causal, band=band)
    heads = q.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, repeat_kv(k, heads), repeat_kv(v, heads), 0.0, causal, scale=scale
    )
    return out.to(acc_dtype(q.dtype)), lse.to(acc_dtype(q.dtype))


@register(
    "attention_block_backward", FLASH, priority=FLASH_PRIORITY, device_types=("cpu",), available=_cpu_flash_available
)
def cpu_flash_attention_block_backward(
    q, k, v, out, lse, dout, *, scale, causal=False, band=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if band is not None or not _same_dtype(q, k, v) or q.dtype == torch.float64:
        return attention_block_backward(q, k, v, out, lse, dout, scale=scale, causal=causal, band=band)
    heads, acc = q.shape[1], acc_dtype(q.dtype)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype),
        q,
        repeat_kv(k, heads),
        repeat_kv(v, heads),
        out.to(q.dtype),
        lse.float().contiguous(),
        0.0,
        causal,
        scale=scale,
    )
    return dq.to(acc), sum_kv(dk.to(acc), k.shape[1]), sum_kv(dv.to(acc), k.shape[1])


def _cuda_flash_available() -> bool:
    return torch.cuda.is_available() and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward")


def cuda_flash_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether CUDA flash attention takes these tensors: fp16/bf16 alike, head dim a multiple of 8 up to 256."""
    d = q.shape[-1]
    return _same_dtype(q, k, v) and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


def _cuda_flash_fits(q, k, v, band) -> bool:
    return band is None and cuda_flash_fits(q, k, v)


@register(
    "attention_block", CUDA_FLASH, priority=FLASH_PRIORITY, device_types=("cuda",), available=_cuda_flash_available
)
def cuda_flash_attention_block(q, k, v, *, scale, causal=False, band=None) -> tuple[torch.Tensor, torch.Tensor]:
    if not _cuda_flash_fits(q, k, v, band):
        return attention_block(q, k, v, scale=scale, causal=causal, band=band)
    heads = q.shape[1]
    result = torch.ops.aten._scaled_dot_product_flash_attention(
        q, repeat_kv(k, heads), repeat_kv(v, heads), 0.0, causal, False, scale=scale
    )
    return result[0].float(), result[1].float()


@register(
    "attention_block_backward",
    CUDA_FLASH,
    priority=FLASH_PRIORITY,
    device_types=("cuda",),
    available=_cuda_flash_available,
)
def cuda_flash_attention_block_backward(
    q, k, v, out, lse, dout, *, scale, causal=False, band=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not _cuda_flash_fits(q, k, v, band):
        return attention_block_backward(q, k, v, out, lse, dout, scale=scale, causal=causal, band=band)
    heads = q.shape[1]
    k_rep, v_rep = repeat_kv(k, heads), repeat_kv(v, heads)
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)  # no dropout: the seed is never read
    # cum_seq_q / cum_seq_k None: the dense (not varlen) kernel, as autograd calls it
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype), q, k_rep, v_rep, out.to(q.dtype), lse.float().contiguous(),
        None, None, q.shape[2], k.shape[2], 0.0, causal, rng, rng, scale=scale,
    )  # fmt: skip
    return dq.float(), sum_kv(dk.float(), k.shape[1]), sum_kv(dv.float(), k.shape[1])
