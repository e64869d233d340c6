"""bf16 and fp16 matmuls as fp32 GEMMs on CPUs without native matrix instructions for that dtype.

PyTorch runs a bf16 matmul on CPU through oneDNN, which is fast only where the CPU has AVX512_BF16 or AMX
(or, on ARM, the BF16 extension); elsewhere (an AVX2-only CPU, or oneDNN held below AVX512_CORE_BF16 by
``ONEDNN_MAX_CPU_ISA``) it falls back to code measured 2.6-19x slower than megacann's fp32 route for the
same shapes (``benchmarks/NOTES.md``). fp16 is alike: without AVX512_FP16 / AMX_FP16 PyTorch's fp16 GEMM
was measured slower than the fp32 one (``benchmarks/NOTES.md``, "Issue 28 (session 7)"). There, megacann's
low-precision products upcast their operands, multiply with the fp32 GEMM and round the result once to the
operands' dtype, in the forward and in both products of the backward (input and weight gradients): the
``linear`` op (column- and row-parallel projections, LoRA's A and B, an MoE expert's own projection;
implementation ``fp32_gemm``), the fused head loss's logits products (:mod:`megacann.ops.head_loss`), the
experts' grouped matmuls (:mod:`megacann.ops.moe_gather`) and the overlapped sequence-parallel projection
(:mod:`megacann.layers.tp_overlap`), each through :func:`gemm_dtype` / :func:`fp32_linear` here.

Numerics: a CPU bf16 or fp16 GEMM already multiplies exact values and accumulates in fp32 before one
rounding, so the two routes differ only in the order of the fp32 sums (and the fp32 route rounds once per
product, as the native one does): results agree within the dtype's round-off (tests/test_ops_bf16_matmul.py
states the bound). (A product of two bf16 or two fp16 values is exact in fp32: 8 + 8 and 11 + 11
significant bits.) Memory: the fp32 copies exist only during each product; the autograd graph saves the
low-precision tensors.

``MEGACANN_CPU_BF16_MATMUL=auto|fp32|bf16`` chooses for both dtypes: ``auto`` (default) runs fp32 GEMMs for
a dtype exactly when the CPU lacks native GEMM for it (:func:`native_gemm`), ``fp32`` always, ``bf16`` never
(PyTorch's own bf16 and fp16 GEMMs). :func:`forced` switches it within a block (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator
from typing import Optional

import torch
import torch.nn.functional as F

from megacann.ops import registry, weight_copies
from megacann.ops.isa import cpu_flags
from megacann.ops.weight_grad import defer_or_compute, deferrable
from megacann.ops.weight_grad import linear as deferrable_linear

ENV = "MEGACANN_CPU_BF16_MATMUL"
CHOICES = ("auto", "fp32", "bf16")
IMPL = "fp32_gemm"  # the registry name of the fp32 route of op ``linear`` (CPU)
PRIORITY = 5
LOW_DTYPES = (torch.bfloat16, torch.float16)  # the dtypes the route serves
# CPU flags (x86 /proc/cpuinfo ``flags``, ARM ``Features``) of native matrix arithmetic per dtype (ARM's
# ``asimdhp``: half-precision SIMD arithmetic, taken as native fp16 without a measurement)
NATIVE_FLAGS = {
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16", "bf16"}),
    torch.float16: frozenset({"avx512_fp16", "amx_fp16", "asimdhp"}),
}
# ONEDNN_MAX_CPU_ISA values that keep oneDNN from its bf16 / fp16 instructions (x86)
_BELOW_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})
ONEDNN_WITHOUT = {torch.bfloat16: _BELOW_BF16, torch.float16: _BELOW_BF16 | {"AVX512_CORE_BF16"}}

_FORCED: Optional[bool] = None


def _low(dtype: torch.dtype) -> torch.dtype:
    if dtype not in LOW_DTYPES:
        raise ValueError(f"the fp32 GEMM route serves {LOW_DTYPES}, not {dtype}")
    return dtype


def native_gemm(
    flags: Iterable[str], onednn_max_isa: Optional[str] = None, dtype: torch.dtype = torch.bfloat16
) -> bool:
    """Whether a CPU with these feature ``flags`` runs ``dtype`` (bf16 or fp16) GEMMs natively, given oneDNN's
    ``ONEDNN_MAX_CPU_ISA`` (None or empty: not held)."""
    held = (onednn_max_isa or "").strip().upper() in ONEDNN_WITHOUT[_low(dtype)]
    return not held and bool(NATIVE_FLAGS[dtype] & frozenset(flags))


def choose(
    flags: Iterable[str],
    onednn_max_isa: Optional[str] = None,
    setting: Optional[str] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> bool:
    """True: run ``dtype`` (bf16 or fp16) matmuls as fp32 GEMMs. ``setting`` is the
    ``MEGACANN_CPU_BF16_MATMUL`` value (None or ``auto``: decide by :func:`native_gemm`); ValueError naming
    the variable otherwise."""
    want = (setting or "auto").strip().lower()
    if want not in CHOICES:
        raise ValueError(f"{ENV}={setting!r}: expected one of {CHOICES}")
    if want == "auto":
        return not native_gemm(flags, onednn_max_isa, dtype)
    return want == "fp32"


@functools.lru_cache(maxsize=len(LOW_DTYPES))
def _from_environment(dtype: torch.dtype) -> bool:
    return choose(cpu_flags(), os.environ.get("ONEDNN_MAX_CPU_ISA"), os.environ.get(ENV), dtype)


def enabled(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this process runs CPU ``dtype`` (bf16 or fp16) matmuls as fp32 GEMMs (:func:`choose` on this
    CPU and the environment, read once; :func:`forced` overrides it for both dtypes)."""
    return _FORCED if _FORCED is not None else _from_environment(_low(dtype))


def any_enabled() -> bool:
    """Whether the route serves bf16 or fp16 here (the ``fp32_gemm`` implementation's availability)."""
    return any(enabled(dtype) for dtype in LOW_DTYPES)


@contextlib.contextmanager
def forced(on: bool) -> Iterator[None]:
    """Run bf16 and fp16 matmuls as fp32 GEMMs (``on``) or natively inside the block, whatever the CPU."""
    global _FORCED
    previous, _FORCED = _FORCED, bool(on)
    registry.refresh()
    try:
        yield
    finally:
        _FORCED = previous
        registry.refresh()


def upcasts(*tensors: torch.Tensor) -> bool:
    """Whether a product of these tensors takes the fp32 route: all bf16, or all fp16, on CPU, and
    :func:`enabled` for that dtype."""
    dtype = tensors[0].dtype
    if dtype not in LOW_DTYPES or any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        return False
    return enabled(dtype)


def gemm_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype to multiply these tensors in: fp32 on the route (:func:`upcasts`), else their own."""
    return torch.float32 if upcasts(*tensors) else tensors[0].dtype


# -- the linear product ------------------------------------------------------------------------------------


class _Fp32Linear(torch.autograd.Function):
    """``F.linear`` of bf16 (or fp16) tensors through fp32 GEMMs; saves the inputs as they are. For a deferrable
    weight (:func:`megacann.ops.weight_grad.deferrable`), its gradient waits for the W pass of a split backward
    (:mod:`megacann.ops.weight_grad`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, deferrable):
        ctx.save_for_backward(x, weight)
        ctx.weight, ctx.deferrable = weight, deferrable
        ctx.bias_dtype = None if bias is None else bias.dtype
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad32 = grad.reshape(-1, grad.shape[-1]).float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad32.mm(weight.float()).view(x.shape).to(x.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = grad32.sum(0).to(ctx.bias_dtype)
        if ctx.needs_input_grad[1]:

            def weight_grad(g32: Optional[torch.Tensor] = None) -> tuple[torch.Tensor]:
                if g32 is None:  # deferred: the closure holds the model-dtype gradient, upcast in W
                    g32 = grad.reshape(-1, grad.shape[-1]).float()
                return (g32.t().mm(x.reshape(-1, x.shape[-1]).float()).to(weight.dtype),)

            (grad_w,) = defer_or_compute((ctx.weight,), weight_grad) if ctx.deferrable else weight_grad(grad32)
        return grad_x, grad_w, grad_b, None


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` of bf16 or fp16 CPU tensors computed by fp32 GEMMs where :func:`upcasts` (otherwise, and
    for other dtypes, the plain product)."""
    if not upcasts(x, weight, *(() if bias is None else (bias,))):
        return deferrable_linear(x, weight, bias)
    if not torch.is_grad_enabled():
        out = weight_copies.product(x, weight, bias, widened=True)  # a generate call's widened copy
        if out is None:
            out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)
    return _Fp32Linear.apply(x, weight, bias, deferrable(weight))


@registry.register("linear", IMPL, priority=PRIORITY, device_types=("cpu",), available=any_enabled)
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return fp32_linear(x, weight, bias)
