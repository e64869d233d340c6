"""The implementations of ``decode_attention`` (declared in :mod:`megacann.ops.signatures`): a decoding
step's queries over the key/value cache, per device.

- ``reference`` (any device; CPU in fp32): the masked attention of :func:`megacann.ops.reference.
  scaled_dot_product_attention` over the cache, ``[b, 1, s, slots]`` mask, no ``[s, s]`` one.
- ``fp32_sdpa`` (cpu): the reference, with bfloat16 and float16 queries, keys and values upcast to fp32 for
  the call and the output rounded back. PyTorch's CPU flash kernel handles one query token a row badly in
  bf16: upcasting and running its fp32 kernel was 3.5x to 38x faster per call at 1 to 16 rows and 128 to
  255 cached tokens (``benchmarks/decode_attention_cpu.py``; benchmarks/NOTES.md), and it rounds once
  instead of after each product. fp32 runs the reference as it is.
- ``cpp`` (cpu, above ``fp32_sdpa``): megacann's C++ kernel (``csrc/decode_attention.cpp``) for one query
  token a row: it reads an fp32 or bf16 cache as it lies (the generator's slice of the preallocated cache,
  no copy, no upcast), each kv head's rows once for the query heads that share it, computes in fp32 and
  rounds the output once, as ``fp32_sdpa`` does. Other calls (several query tokens, a mask of another
  shape, a gradient to compute, an fp16 cache, a library built without the kernel) run ``fp32_sdpa``. The
  op itself reads fp16 too; the route leaves fp16 to ``fp32_sdpa``, which measured faster at batch 16.
- ``grouped_sdpa`` (cuda): one ``F.scaled_dot_product_attention`` call in which the query heads that share
  a kv head are rows of one head (``[b, hkv, g * s, d]`` against ``[b, hkv, slots, d]``), so grouped-query
  attention reads the cache as it lies, never copied per query head, and a boolean mask keeps PyTorch's
  memory-efficient kernel eligible (the flash kernel takes no mask).
- ``npu`` (npu): torch_npu's incremental flash attention,
  ``npu_incre_flash_attention(query, key, value, *, atten_mask=, num_heads=, scale_value=,
  input_layout="BSH", num_key_value_heads=)``: query ``[b, 1, hq * d]``, key and value ``[b, slots, hkv *
  d]`` (contiguous, as the kernel requires), the mask as its complement (bool, True = excluded) in
  ``[b, 1, 1, slots]``; float16 and bfloat16, one query token a row, as documented. Other calls (fp32, more
  than one query token, ``sinks``) run the reference. A torch_npu without the kernel falls back to the
  reference with one log line (:func:`megacann.ops.npu_api.supports`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megacann.accelerator import import_torch_npu
from megacann.ops import cpp, npu_api, reference
from megacann.ops.registry import REFERENCE, register

GROUPED_SDPA, NPU, FP32_SDPA, CPP = "grouped_sdpa", "npu", "fp32_sdpa", "cpp"
HALF_DTYPES = (torch.float16, torch.bfloat16)
INCRE_KERNEL = "npu_incre_flash_attention"
INCRE_DTYPES = (torch.float16, torch.bfloat16)  # the kernel's documented query dtypes


@register("decode_attention", REFERENCE)
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return reference.scaled_dot_product_attention(
        q, k_cache, v_cache, causal=False, attn_mask=attn_mask, scale=scale, sinks=sinks
    )


@register("decode_attention", FP32_SDPA, priority=10, device_types=("cpu",))
def fp32_decode_attention(q, k_cache, v_cache, *, attn_mask=None, scale=None, sinks=None) -> torch.Tensor:
    """The reference in fp32 for half-precision inputs, rounded back to their dtype (fp32: the reference)."""
    if q.dtype not in HALF_DTYPES:
        return decode_attention(q, k_cache, v_cache, attn_mask=attn_mask, scale=scale, sinks=sinks)
    out = decode_attention(
        q.float(),
        k_cache.float(),
        v_cache.float(),
        attn_mask=attn_mask,
        scale=scale,
        sinks=None if sinks is None else sinks.float(),
    )
    return out.to(q.dtype)


# the caches the route hands the kernel: it reads fp16 too (torch.ops.megacann.decode_attention), but its
# portable widening of fp16 measured slower than fp32_sdpa at batch 16 (benchmarks/decode_attention_cpu.py)
CPP_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def _has_cpp_kernel() -> bool:
    """The C++ library loaded and holds the kernel (a library built before it does not)."""
    return cpp.available() and hasattr(torch.ops.megacann, "decode_attention")


def _cpp_takes(q, k_cache, v_cache, attn_mask, sinks) -> bool:
    b, s, hq, d = q.shape
    used, hkv = k_cache.shape[1], k_cache.shape[2]
    mask_fits = attn_mask is None or (
        attn_mask.dtype == torch.bool and tuple(attn_mask.shape) in ((b, 1, 1, used), (1, 1, 1, used))
    )
    return (
        s == 1
        and k_cache.dtype in CPP_CACHE_DTYPES
        and v_cache.dtype == k_cache.dtype == q.dtype
        and k_cache.shape == v_cache.shape
        and k_cache.shape[0] == b
        and k_cache.shape[3] == d
        and used > 0
        and hq % hkv == 0
        and mask_fits
        and not (
            torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, sinks))
        )
    )


@register("decode_attention", CPP, priority=20, device_types=("cpu",), available=_has_cpp_kernel)
def cpp_decode_attention(q, k_cache, v_cache, *, attn_mask=None, scale=None, sinks=None) -> torch.Tensor:
    """The C++ kernel for one query token a row, its fp32 output rounded once to the queries' dtype; other
    calls run ``fp32_sdpa``."""
    if not _cpp_takes(q, k_cache, v_cache, attn_mask, sinks):
        return fp32_decode_attention(q, k_cache, v_cache, attn_mask=attn_mask, scale=scale, sinks=sinks)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.ops.megacann.decode_attention(q, k_cache, v_cache, attn_mask, scale, sinks)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


@register("decode_attention", GROUPED_SDPA, priority=10, device_types=("cuda",))
def grouped_decode_attention(q, k_cache, v_cache, *, attn_mask=None, scale=None, sinks=None) -> torch.Tensor:
    """The query heads of each kv head as the rows of one SDPA head: kv head ``j`` serves query heads
    ``j*g .. j*g+g-1``, so ``[b, s, hkv, g, d]`` -> ``[b, hkv, g * s, d]`` (row ``i * s + t``: head ``j*g+i``,
    token ``t``), and the mask ``[b, 1, s, slots]`` repeats ``g`` times along the rows."""
    if sinks is not None:
        return decode_attention(q, k_cache, v_cache, attn_mask=attn_mask, scale=scale, sinks=sinks)
    b, s, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of key/value heads {hkv}")
    group = hq // hkv
    rows = q.reshape(b, s, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * s, d)
    mask = None if attn_mask is None else attn_mask.repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(
        rows, k_cache.transpose(1, 2), v_cache.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.view(b, hkv, group, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, hq, d)


def _incre_available() -> bool:
    return npu_api.supports("decode_attention", NPU, INCRE_KERNEL, instead="the reference (masked attention)")


@register("decode_attention", NPU, priority=20, device_types=("npu",), available=_incre_available)
def npu_decode_attention(q, k_cache, v_cache, *, attn_mask=None, scale=None, sinks=None) -> torch.Tensor:
    b, s, hq, d = q.shape
    if s != 1 or q.dtype not in INCRE_DTYPES or sinks is not None:
        return decode_attention(q, k_cache, v_cache, attn_mask=attn_mask, scale=scale, sinks=sinks)
    slots, hkv = k_cache.shape[1], k_cache.shape[2]
    excluded = None if attn_mask is None else ~attn_mask.reshape(b, 1, 1, slots)
    out = import_torch_npu().npu_incre_flash_attention(
        q.contiguous().view(b, 1, hq * d),
        k_cache.contiguous().view(b, slots, hkv * d),
        v_cache.contiguous().view(b, slots, hkv * d),
        atten_mask=excluded,
        num_heads=hq,
        scale_value=scale if scale is not None else 1.0 / math.sqrt(d),
        input_layout="BSH",
        num_key_value_heads=hkv,
    )
    return out.view(b, 1, hq, d)
