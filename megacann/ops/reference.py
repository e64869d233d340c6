"""PyTorch reference implementations of the ops declared in :mod:`megacann.ops.signatures`: correct on any
device, and the baseline fused kernels are tested against.

Layouts: attention tensors are ``[batch, seq, heads, head_dim]`` (BSND, the layout of flash-attention and
``npu_fusion_attention``); rotary ``cos``/``sin`` are ``[batch, seq, head_dim]`` or ``[seq, head_dim]``.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from megacann.constants import IGNORE_INDEX
from megacann.ops.attention_sinks import attention_with_sinks, check_sinks
from megacann.ops.registry import REFERENCE, register
from megacann.ops.weight_grad import linear as deferrable_linear

_TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_SDPA_HAS_GQA = _TORCH_VERSION >= (2, 5)


def effective_window(sliding_window: Optional[int], seq_len: int, causal: bool) -> Optional[int]:
    """The sliding window that changes anything: None when it is unset or covers the whole sequence.
    A window needs causal attention (each query sees its last ``sliding_window`` keys, itself included)."""
    if sliding_window is None:
        return None
    if not causal:
        raise ValueError("sliding_window needs causal attention (causal=True)")
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive number of keys, got {sliding_window}")
    return None if sliding_window >= seq_len else int(sliding_window)


def attention_mask(
    seq_len: int,
    causal: bool,
    segment_ids: Optional[torch.Tensor],
    device: torch.device,
    sliding_window: Optional[int] = None,
) -> Optional[torch.Tensor]:
    """Boolean mask, True where a query may attend to a key: ``[b, 1, s, s]`` (or ``[s, s]``), or None.
    ``sliding_window`` W (causal only): query ``i`` sees keys ``i-W+1 .. i`` (Hugging Face Mistral's band).

    The mask of the last ``segment_ids`` tensor seen is kept, so the layers of one model, which all get
    the same tensor, build it once per step."""
    if segment_ids is not None:
        key = (seq_len, causal, device, segment_ids._version, sliding_window)
        cached = _MASK_CACHE.get("entry")
        if cached is not None and cached[0] == key and cached[1]() is segment_ids:
            return cached[2]
    mask = None
    if causal:
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril_()
        if sliding_window is not None:
            mask.triu_(1 - sliding_window)  # keys more than W-1 behind the query are out
    if segment_ids is not None:
        same = (segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)).unsqueeze(1)
        mask = same if mask is None else same & mask
        _MASK_CACHE["entry"] = (key, weakref.ref(segment_ids), mask)
    return mask


_MASK_CACHE: dict[str, tuple] = {}


@register("scaled_dot_product_attention", REFERENCE)
def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    segment_ids: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention over BSND tensors; ``k``/``v`` may have fewer heads than ``q`` (GQA/MQA: kv head ``j``
    serves q heads ``j*g .. j*g+g-1``). ``segment_ids`` ``[b, s]`` restricts attention to equal ids
    (packed documents); ``attn_mask`` is boolean, True = attend; ``sliding_window`` W (causal only) lets
    each query see its last W keys, itself included; ``sinks`` ``[hq]`` adds a sink column per head
    (:func:`~megacann.ops.attention_sinks.attention_with_sinks`). Returns ``[b, s, hq, d]``."""
    hq, hkv = q.shape[2], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of key/value heads {hkv}")
    check_sinks(sinks, hq)
    window = effective_window(sliding_window, q.shape[1], causal)
    mask = None
    if segment_ids is not None or attn_mask is not None or window is not None or (sinks is not None and causal):
        mask = attention_mask(q.shape[1], causal, segment_ids, q.device, window)
        if attn_mask is not None:
            mask = attn_mask if mask is None else mask & attn_mask
    if sinks is not None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return attention_with_sinks(q, k, v, mask, sinks, scale, dropout_p)
    extra = {}
    if hq != hkv:
        if _SDPA_HAS_GQA:
            extra["enable_gqa"] = True
        else:
            k = k.repeat_interleave(hq // hkv, dim=2)
            v = v.repeat_interleave(hq // hkv, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=causal and mask is None,
        scale=scale,
        **extra,
    )
    return out.transpose(1, 2)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm with a hand-written backward: saves the normalised input and 1/rms, nothing in fp32 but
    the row statistics. Bitwise equal to Hugging Face's LlamaRMSNorm in fp32."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        variance = x.pow(2).mean(-1, keepdim=True, dtype=torch.float32)
        rstd = torch.rsqrt(variance + eps).to(x.dtype)
        y = x * rstd
        ctx.save_for_backward(y, rstd, weight)
        return weight * y

    @staticmethod
    def backward(ctx, grad):
        y, rstd, weight = ctx.saved_tensors
        grad_y = grad * weight
        dot = (grad_y * y).mean(-1, keepdim=True, dtype=torch.float32).to(y.dtype)
        grad_x = (grad_y - y * dot) * rstd
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * y).reshape(-1, y.shape[-1]).sum(0)
        return grad_x, grad_w, None


@register("linear", REFERENCE)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return deferrable_linear(x, weight, bias)


@register("rms_norm", REFERENCE)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x²) + eps)`` over the last dim."""
    return _RMSNorm.apply(x, weight, eps)


@register("apply_rotary", REFERENCE)
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x`` ``[b, s, heads, d]`` by the angles whose cos/sin are given (``[b, s, d]`` or ``[s, d]``).

    ``interleaved=False`` (Hugging Face LLaMA, GPT-NeoX): dims ``i`` and ``i + d/2`` form a pair, and
    ``cos = cat(cos_f, cos_f)``. ``interleaved=True`` (GPT-J, original RoPE): dims ``2i`` and ``2i+1`` form
    a pair, and ``cos = repeat_interleave(cos_f, 2)``. The result has ``x``'s dtype."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if interleaved:
        c, s = cos[..., 0::2].unsqueeze(-2), sin[..., 0::2].unsqueeze(-2)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    c, s = cos[..., :half].unsqueeze(-2), sin[..., :half].unsqueeze(-2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@register("swiglu", REFERENCE)
def swiglu(x: torch.Tensor, up: Optional[torch.Tensor] = None, *, overwrite_input: bool = False) -> torch.Tensor:
    """``silu(gate) * up``: with ``up`` given, ``x`` is the gate; otherwise ``x`` is a fused gate|up
    projection whose last dim holds the gate then the up half (``overwrite_input`` is a permission this
    implementation does not use)."""
    if up is None:
        x, up = x.chunk(2, dim=-1)
    return F.silu(x) * up


@register("cross_entropy", REFERENCE)
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token cross entropy in fp32 (shape of ``target``; 0 where ``target == ignore_index``) of
    ``logits`` ``[..., V]`` in any float dtype."""
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.dtype != torch.float64:
        flat = flat.float()
    loss = F.cross_entropy(flat, target.reshape(-1), ignore_index=ignore_index, reduction="none")
    return loss.view(target.shape)
