"""Fused operators behind one name each; layers call these functions, never a kernel directly.

Each function below picks, by the device type of its first tensor, the best available implementation
registered in :mod:`megacann.ops.registry`:

==========  ===============================================================================  ============
name        what                                                                             device types
==========  ===============================================================================  ============
npu         torch_npu's CANN kernels (:mod:`megacann.ops.npu`)                               npu
cpp         megacann's C++ kernels from ``csrc/`` (:mod:`megacann.ops.cpp`)                  cpu
fused       the kernel behind ``torch.optim.AdamW(fused=True)`` (``adamw_step_``)            cpu, cuda
compiled    ``torch.compile`` of norm, RoPE, SwiGLU, head loss; opt-in (``ops.cuda``)        cuda
apex        apex's fused RMSNorm, opt-in, if installed                                       cuda
reference   PyTorch (:mod:`megacann.ops.reference`), always there                             any
==========  ===============================================================================  ============

Optional packages are imported lazily by each implementation's availability check, so ``import
megacann.ops`` never imports torch_npu or builds the C++ kernels. :func:`configure` applies the recipe's
``precision.fused_ops`` / ``precision.fp32_ops``; :func:`selection_line` names the choice per op.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megacann.ops import adamw as _adamw  # noqa: F401  (each module registers its implementations)
from megacann.ops import cpp as _cpp  # noqa: F401
from megacann.ops import cuda as _cuda  # noqa: F401
from megacann.ops import head_loss as _head_loss
from megacann.ops import npu as _npu  # noqa: F401
from megacann.ops import reference as _reference  # noqa: F401
from megacann.ops.moe import grouped_matmul, moe_permute, moe_unpermute
from megacann.ops.registry import (
    check_op_names,
    configure,
    fp32_ops,
    fused_enabled,
    implementations,
    log_selection,
    ops,
    pin,
    register,
    resolve,
    selected,
    selection,
    selection_line,
)

# Ops that recipes compute in fp32 by default (``precision.fp32_ops``); see docs/ops.md for why.
DEFAULT_FP32_OPS = ("rms_norm",)

__all__ = [
    "DEFAULT_FP32_OPS",
    "adamw_step_",
    "apply_rotary",
    "check_op_names",
    "configure",
    "cross_entropy",
    "fp32_ops",
    "fused_enabled",
    "grouped_matmul",
    "implementations",
    "log_selection",
    "moe_permute",
    "moe_unpermute",
    "ops",
    "pin",
    "register",
    "resolve",
    "rms_norm",
    "scaled_dot_product_attention",
    "selected",
    "selection",
    "selection_line",
    "swiglu",
    "vocab_parallel_head_loss",
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
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """Attention over ``[b, s, heads, d]`` tensors with GQA, causal, sliding-window and packed-segment
    masking; see :func:`megacann.ops.reference.scaled_dot_product_attention`."""
    fn = resolve("scaled_dot_product_attention", q.device.type)
    return fn(
        q,
        k,
        v,
        causal=causal,
        segment_ids=segment_ids,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        scale=scale,
        sliding_window=sliding_window,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation over the last dim, scaled by ``weight``."""
    return resolve("rms_norm", x.device.type)(x, weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[b, s, heads, d]`` (half-rotation or interleaved pairs)."""
    return resolve("apply_rotary", x.device.type)(x, cos, sin, interleaved)


def swiglu(x: torch.Tensor, up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(gate) * up``, from a fused gate|up tensor ``x`` or from ``x`` = gate and ``up``."""
    return resolve("swiglu", x.device.type)(x, up)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross entropy in fp32: shape of ``target``, 0 where ``target == ignore_index``."""
    return resolve("cross_entropy", logits.device.type)(logits, target, ignore_index)


def vocab_parallel_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: Optional[int] = None,
    ignore_index: int = -100,
    group: Optional[dist.ProcessGroup] = None,
    chunk_size: int = _head_loss.DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Per-token fp32 loss of the output head ``hidden @ weight.T`` (``weight``: this TP rank's vocabulary
    shard) computed in chunks of ``chunk_size`` tokens, never holding the whole batch's logits. Equal to
    ``F.linear`` + :func:`megacann.layers.vocab_parallel_cross_entropy`; see :mod:`megacann.ops.head_loss`."""
    fn = resolve("vocab_parallel_head_loss", hidden.device.type)
    return fn(
        hidden, weight, target, vocab_size=vocab_size, ignore_index=ignore_index, group=group, chunk_size=chunk_size
    )


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """One AdamW update of flat fp32 buffers in place, as ``torch.optim.AdamW``; ``step`` counts from 1."""
    resolve("adamw_step_", param.device.type)(
        param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step
    )
