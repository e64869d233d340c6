"""The fake ``torch_npu.npu_quant_matmul`` (attached by tests/fake_torch_npu.py): torch_npu's documented
signature ``npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
output_dtype=None)`` and its documented limits, computed independently of megacann:

- ``x1`` ``[..., m, k]`` and ``x2`` ``[..., k, n]``, 2 to 6 dimensions; the integer inputs of the torch_npu
  documentation (int8) or the FP8 ones CANN's quantised matmul (aclnnQuantMatmulV5) lists (float8_e4m3fn,
  float8_e5m2);
- ``scale`` 1-D ``(1,)`` or ``(n,)`` (float32 or bfloat16): the per-tensor or per-output-channel multiplier;
- ``pertoken_scale`` 1-D ``(m,)`` float32: one multiplier per row of ``x1``;
- ``offset`` (int8 output only) and ``bias`` 1-D ``(n,)``;
- ``output_dtype`` None (int8), torch.int8, torch.float16 or torch.bfloat16; anything else is refused.

Result: ``(x1 @ x2) * scale [* pertoken_scale per row] + bias`` accumulated in fp32, in ``output_dtype``.
"""

from __future__ import annotations

from typing import Optional

import torch

INPUT_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
OUTPUT_DTYPES = (None, torch.int8, torch.float16, torch.bfloat16)


def npu_quant_matmul(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    *,
    offset: Optional[torch.Tensor] = None,
    pertoken_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    output_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    assert 2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6, "x1 and x2 take 2 to 6 dimensions"
    assert x1.dtype in INPUT_DTYPES and x2.dtype in INPUT_DTYPES, (x1.dtype, x2.dtype)
    assert (x1.dtype == torch.int8) == (x2.dtype == torch.int8), "int8 pairs with int8 only"
    m, k = x1.shape[-2:]
    assert x2.shape[-2] == k, f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} do not chain"
    n = x2.shape[-1]
    assert scale.dim() == 1 and scale.shape[0] in (1, n), f"scale must be (1,) or ({n},), got {tuple(scale.shape)}"
    assert scale.dtype in (torch.float32, torch.bfloat16), scale.dtype
    assert output_dtype in OUTPUT_DTYPES, f"output_dtype {output_dtype} is not supported"
    out = (x1.float() @ x2.float()) * scale.float()
    if pertoken_scale is not None:
        assert pertoken_scale.dtype == torch.float32 and tuple(pertoken_scale.shape) == (m,), pertoken_scale.shape
        assert output_dtype in (torch.float16, torch.bfloat16), "pertoken_scale gives float16 / bfloat16 results"
        out = out * pertoken_scale.unsqueeze(-1)
    if offset is not None:
        assert output_dtype in (None, torch.int8) and offset.dim() == 1, "offset goes with int8 results"
        out = out + offset.float()
    if bias is not None:
        assert bias.dim() == 1 and bias.shape[0] == n, f"bias must be ({n},)"
        out = out + bias.float()
    if output_dtype in (None, torch.int8):
        return out.round().clamp(-128, 127).to(torch.int8)
    return out.to(output_dtype)


def kernels(npu, release) -> list:
    """This file's kernels, for the fake module to attach (every release has the quantised matmul)."""
    return [npu_quant_matmul]
