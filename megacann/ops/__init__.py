"""Fused operators behind one name each; layers call these functions, never a kernel directly.

Each op is declared once in :mod:`megacann.ops.signatures` (signature and docstring); its public function
here picks, by the device type of its first tensor, the best available implementation registered in
:mod:`megacann.ops.registry`:

============  =========================================================================  ============
name          what                                                                       device types
============  =========================================================================  ============
npu           torch_npu's CANN kernels (:mod:`megacann.ops.npu`, ``ops.fp8_npu``)        npu
flash_varlen  packed attention by flash-attention's varlen kernel (``ops.varlen``)       cuda
cpp           megacann's C++ kernels from ``csrc/`` (:mod:`megacann.ops.cpp`)            cpu
varlen        packed / windowed attention per document, no mask (``ops.varlen``)         cpu, cuda
flash         block attention and its lse by PyTorch's CPU flash kernel                  cpu
cuda_flash    block attention and its lse by PyTorch's CUDA flash kernel                 cuda
grouped_sdpa  decode attention, a kv head's query heads as rows of one SDPA head         cuda
fused         the kernel behind ``torch.optim.AdamW(fused=True)`` (``adamw_step_``)      cpu, cuda
chunked       the gated delta rule in chunks of 64 tokens (``ops.gated_delta``)           cpu, cuda
fla           the gated delta rule by flash-linear-attention, if installed                cuda
fp32_gemm     bf16/fp16 ``linear``, ``grouped_matmul`` as fp32 GEMMs (no native GEMM)   cpu
scaled_mm     ``fp8_linear``'s tensorwise / rowwise products by ``torch._scaled_mm``     cpu, cuda
compiled      ``torch.compile`` of norm, RoPE, SwiGLU, head loss; opt-in (``ops.cuda``)  cuda
apex          apex's fused RMSNorm, opt-in, if installed                                 cuda
reference     PyTorch (:mod:`megacann.ops.reference`), always there                      any
============  =========================================================================  ============

Optional packages are imported lazily by each implementation's availability check, so ``import
megacann.ops`` never imports torch_npu or builds the C++ kernels. :func:`configure` applies the recipe's
``precision.fused_ops`` / ``precision.fp32_ops``; :func:`selection_line` names the choice per op.
"""

from __future__ import annotations

# The declarations first: the modules below register implementations under the declared names.
from megacann.ops.signatures import (
    adamw_step_,
    apply_rotary,
    attention_block,
    attention_block_backward,
    cross_entropy,
    decode_attention,
    fp8_linear,
    gated_delta_rule,
    grouped_matmul,
    linear,
    moe_permute,
    moe_unpermute,
    rms_norm,
    scaled_dot_product_attention,
    swiglu,
    vocab_parallel_head_loss,
)

# isort: split
from megacann.ops import adamw as _adamw  # noqa: F401  (each module registers its implementations)
from megacann.ops import attention_blocks as _attention_blocks  # noqa: F401
from megacann.ops import bf16_matmul as _bf16_matmul  # noqa: F401
from megacann.ops import cpp as _cpp  # noqa: F401
from megacann.ops import cuda as _cuda  # noqa: F401
from megacann.ops import decode as _decode  # noqa: F401
from megacann.ops import fp8 as _fp8  # noqa: F401
from megacann.ops import fp8_npu as _fp8_npu  # noqa: F401
from megacann.ops import gated_delta as _gated_delta  # noqa: F401
from megacann.ops import head_loss as _head_loss  # noqa: F401
from megacann.ops import moe as _moe  # noqa: F401
from megacann.ops import moe_gather as _moe_gather  # noqa: F401
from megacann.ops import npu as _npu  # noqa: F401
from megacann.ops import reference as _reference  # noqa: F401
from megacann.ops import varlen as _varlen  # noqa: F401
from megacann.ops.registry import (
    check_op_names,
    configure,
    declare,
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
    "attention_block",
    "attention_block_backward",
    "check_op_names",
    "configure",
    "cross_entropy",
    "declare",
    "decode_attention",
    "fp32_ops",
    "fp8_linear",
    "fused_enabled",
    "gated_delta_rule",
    "grouped_matmul",
    "implementations",
    "linear",
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
