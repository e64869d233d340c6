"""CUDA implementations beyond the reference.

Attention: the reference calls ``F.scaled_dot_product_attention`` (the flash kernel for the causal,
mask-free case); packed documents and sliding windows take :mod:`megacann.ops.varlen` (``flash_varlen``:
flash-attention's varlen kernel, no mask), and context-parallel blocks the CUDA flash kernel with its
log-sum-exp (:mod:`megacann.ops.attention_blocks`). AdamW's fused kernel is :mod:`megacann.ops.adamw`
(``fused``, CPU and CUDA).

Registered here, opt-in (priority below the reference until a GPU benchmark shows a win; select with
``megacann.ops.pin(op, name)``):

- ``compiled``: ``torch.compile`` of the norm / RoPE / SwiGLU math, one generated kernel per op and shape
  family; and of the fused head loss's per-chunk arithmetic (log-sum-exp and target logit forward, the
  logits' gradient backward: one or two passes over a chunk's logits instead of about ten eager ones; the
  chunk matmuls stay cuBLAS calls). Needs Triton. Compiles on first call.
- ``apex``: apex's fused RMSNorm, when apex is installed.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable, Optional

import torch

from megacann.ops import head_loss, reference
from megacann.ops.registry import register

COMPILED = "compiled"
APEX = "apex"
OPT_IN = -1  # below the reference's 0: used only when pinned


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def rms_norm_math(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 with one rounding at the end (the form torch.compile fuses into one kernel)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(torch.promote_types(x.dtype, weight.dtype))


def rotary_math(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """The reference rotation computed in fp32 (tables not rounded to ``x``'s dtype), cast back once."""
    return reference.apply_rotary(x.float(), cos.float(), sin.float(), interleaved).to(x.dtype)


def swiglu_math(x: torch.Tensor, up: Optional[torch.Tensor] = None, *, overwrite_input: bool = False) -> torch.Tensor:
    if up is None:
        x, up = x.chunk(2, dim=-1)
    return (torch.nn.functional.silu(x.float()) * up.float()).to(x.dtype)


def compiled(fn: Callable) -> Callable:
    """``fn`` under ``torch.compile``, compiled on first call (not at import)."""
    holder: dict[str, Callable] = {}

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if "fn" not in holder:
            holder["fn"] = torch.compile(fn, dynamic=None)
        return holder["fn"](*args, **kwargs)

    return run


_cuda_compiled = dict(priority=OPT_IN, device_types=("cuda",), available=_triton_available)
compiled_rms_norm = register("rms_norm", COMPILED, **_cuda_compiled)(compiled(rms_norm_math))
compiled_apply_rotary = register("apply_rotary", COMPILED, **_cuda_compiled)(compiled(rotary_math))
compiled_swiglu = register("swiglu", COMPILED, **_cuda_compiled)(compiled(swiglu_math))


COMPILED_HEAD_KERNELS = head_loss.ShardKernels(compiled(head_loss.torch_stats), compiled(head_loss.torch_grad_))


@register("vocab_parallel_head_loss", COMPILED, **_cuda_compiled)
def compiled_head_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **kwargs) -> torch.Tensor:
    """:func:`megacann.ops.head_loss.head_loss` with its per-chunk arithmetic compiled."""
    return head_loss.head_loss(hidden, weight, target, kernels=COMPILED_HEAD_KERNELS, **kwargs)


def _apex_available() -> bool:
    return importlib.util.find_spec("apex") is not None and torch.cuda.is_available()


@register("rms_norm", APEX, priority=OPT_IN - 1, device_types=("cuda",), available=_apex_available)
def apex_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine

    return fused_rms_norm_affine(x, weight, weight.shape, eps)
