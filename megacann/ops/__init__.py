"""Fused operators behind one name each; layers call these functions, never a kernel directly.

Each function below picks, by the device type of its first tensor, the best available implementation
registered in :mod:`megacann.ops.registry` (the PyTorch reference in :mod:`megacann.ops.reference` is
always there). A torch_npu, C++ (``csrc/``) or CUDA implementation registers under the same op name with
``register(op, name, priority=..., device_types=(...), available=...)``; its availability check imports
its package lazily, so ``import megacann.ops`` never imports torch_npu.
"""

from __future__ import annotations

from typing import Optional

import torch

from megacann.ops import reference as _reference  # noqa: F401  (registers the reference implementations)
from megacann.ops.moe import grouped_matmul, moe_permute, moe_unpermute
from megacann.ops.registry import implementations, pin, register, resolve, selected

__all__ = [
    "apply_rotary",
    "grouped_matmul",
    "implementations",
    "moe_permute",
    "moe_unpermute",
    "pin",
    "register",
    "resolve",
    "rms_norm",
    "scaled_dot_product_attention",
    "selected",
    "swiglu",
]


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
) -> torch.Tensor:
    """Attention over ``[b, s, heads, d]`` tensors with GQA, causal and packed-segment masking; see
    :func:`megacann.ops.reference.scaled_dot_product_attention`."""
    fn = resolve("scaled_dot_product_attention", q.device.type)
    return fn(q, k, v, causal=causal, segment_ids=segment_ids, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation over the last dim, scaled by ``weight``."""
    return resolve("rms_norm", x.device.type)(x, weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[b, s, heads, d]`` (half-rotation or interleaved pairs)."""
    return resolve("apply_rotary", x.device.type)(x, cos, sin, interleaved)


def swiglu(x: torch.Tensor, up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(gate) * up``, from a fused gate|up tensor ``x`` or from ``x`` = gate and ``up``."""
    return resolve("swiglu", x.device.type)(x, up)
