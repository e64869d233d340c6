"""For the tests of megacann.ops.bf16_matmul's fp32 GEMM route and of the layers that take it: the matmuls
a block runs, by dtype (:class:`Products`), and the error bound of a bf16 or fp16 product against the float64
product of the same inputs.

A product of two bf16 (or two fp16) values is exact in fp32 and float64, so a GEMM that accumulates in fp32
and rounds once differs from the float64 product only by fp32 accumulation (at most k * 2^-24 * sum|a||b|
for k terms) and by the final rounding to the dtype (at most u = 2^-8 for bf16, 2^-11 for fp16, relative;
fp16's subnormals add at most 2^-25 absolute). Every element must lie within
u * |ref| + k * 2^-22 * (|a| @ |b|) (+ 2^-25 for fp16) of the float64 reference: the accumulation term with a
margin of 4 for the rounding of partial sums in blocked GEMMs. The native bf16 / fp16 GEMMs meet it too.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm"}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def bound(ref: torch.Tensor, absprod: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    tiny = 2.0**-25 if dtype == torch.float16 else 0.0
    return UNIT_ROUNDOFF[dtype] * ref.abs() + k * 2.0**-22 * absprod + tiny


def assert_within(got: torch.Tensor, ref: torch.Tensor, absprod: torch.Tensor, k: int, name: str = "") -> None:
    """``got`` (bf16 or fp16) within :func:`bound` of the float64 ``ref``; ``absprod`` is ``|a| @ |b|``."""
    limit = bound(ref, absprod, k, got.dtype)
    err = (got.double().reshape(ref.shape) - ref).abs()
    assert bool((err <= limit).all()), (name, float((err / limit).max()))


def assert_chain_within(got: torch.Tensor, ref: torch.Tensor, absprod: torch.Tensor, name: str = "") -> None:
    """``got`` from two chained products (and a scaling) with a rounding between them, as LoRA's ``s B (A x)``
    and its gradients: within ``u |ref| + 4 u absprod`` (+ 2^-25 for fp16) of the float64 ``ref``, where
    ``absprod`` is the chain's product of absolute values (scaling included). The intermediate's and the
    scaling's roundings (2u) and both accumulations (k * 2^-22 << u at these sizes) fit in the 4u."""
    u = UNIT_ROUNDOFF[got.dtype]
    limit = u * ref.abs() + 4 * u * absprod + (2.0**-25 if got.dtype == torch.float16 else 0.0)
    err = (got.double().reshape(ref.shape) - ref).abs()
    assert bool((err <= limit).all()), (name, float((err / limit).max()))


class Products(TorchDispatchMode):
    """Counts the matmuls run inside it by the dtype of their first operand (``dtypes``) and keeps the
    shapes of the low-precision ones (``low``); each group of ``megacann::grouped_mm_`` (the C++ grouped
    products, which call the GEMM below the dispatcher) counts as one ``mm``."""

    def __init__(self):
        super().__init__()
        self.dtypes: dict[str, int] = {}
        self.low: list[tuple] = []

    def _count(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        key = str(a.dtype)
        self.dtypes[key] = self.dtypes.get(key, 0) + 1
        if a.dtype in (torch.bfloat16, torch.float16):
            self.low.append((name, tuple(a.shape), tuple(b.shape)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in MATMULS:
            self._count(name, args[0], args[1])
        elif name == "grouped_mm_":
            for a, b in zip(args[1], args[2]):
                self._count("mm", a, b)
        return func(*args, **(kwargs or {}))
