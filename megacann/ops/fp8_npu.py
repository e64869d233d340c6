"""``fp8_linear`` on Ascend NPUs: the tensorwise and rowwise products by torch_npu's quantised matmul
(implementation ``npu``, device type ``npu``); the block recipes run the reference products.

The call follows torch_npu's documented signature ``npu_quant_matmul(x1, x2, scale, *, offset=None,
pertoken_scale=None, bias=None, output_dtype=None)``: ``x1`` ``[m, k]`` and ``x2`` ``[k, n]`` (the FP8
operands, the second one transposed), ``scale`` ``(1,)`` or ``(n,)`` and ``pertoken_scale`` ``(m,)``
(float32), the result ``(x1 @ x2) * scale * pertoken_scale``. Tensorwise passes the product of the two
scales as ``scale``; rowwise the weight-side rows' scales as ``scale`` and the other operand's as
``pertoken_scale``. Block scales (blockwise, mxfp8) have no place in that signature, so those recipes
multiply by the reference GEMM, said once per recipe (logger ``megacann.ops``). The documented result
types are int8, float16 and bfloat16: the products come back in bfloat16 (fp32 accumulation inside the
kernel), which rounds each output element to 8 bits of mantissa before the fp32 bias and gradients.
Without ``npu_quant_matmul`` the op resolves to the reference, said once by :mod:`megacann.ops.npu_api`.
"""

from __future__ import annotations

import logging

import torch

from megacann.accelerator import import_torch_npu
from megacann.ops import npu_api
from megacann.ops.fp8 import implementation, reference_gemm
from megacann.ops.fp8_formats import Quantized
from megacann.ops.npu import NPU, PRIORITY
from megacann.ops.registry import register

logger = logging.getLogger("megacann.ops")
NPU_QUANT_RECIPES = ("tensorwise", "rowwise")
RESULT_DTYPE = torch.bfloat16  # of the kernel's documented output types, the one that keeps an fp32 range
_said: set[str] = set()


def npu_quant_gemm(a: Quantized, b: Quantized) -> torch.Tensor:
    """``A @ B.T`` (fp32) by ``npu_quant_matmul`` with per-tensor or per-row scales."""
    m, n = a.data.shape[0], b.data.shape[0]
    if a.scale.numel() == 1 and b.scale.numel() == 1:
        scale, pertoken = (a.scale * b.scale).reshape(1).float(), None
    else:
        scale, pertoken = b.scale.reshape(n).float(), a.scale.reshape(m).float()
    out = import_torch_npu().npu_quant_matmul(
        a.data, b.data.t(), scale, pertoken_scale=pertoken, output_dtype=RESULT_DTYPE
    )
    return out.float()


def _gemm_for(recipe: str):
    if recipe in NPU_QUANT_RECIPES:
        return npu_quant_gemm
    if recipe not in _said:
        _said.add(recipe)
        logger.warning(
            "megacann.ops: fp8_linear recipe %r runs the reference products on NPU (npu_quant_matmul takes "
            "per-tensor and per-row scales only)",
            recipe,
        )
    return reference_gemm


def _available() -> bool:
    return npu_api.supports("fp8_linear", NPU, "npu_quant_matmul")


fp8_linear_npu = register("fp8_linear", NPU, priority=PRIORITY, device_types=("npu",), available=_available)(
    implementation(_gemm_for)
)


def forget() -> None:
    """Say the block recipes' fallback again (tests that swap torch_npu)."""
    _said.clear()
