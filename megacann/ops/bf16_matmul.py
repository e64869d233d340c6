"""bf16 matmuls as fp32 GEMMs on CPUs without native bf16 matrix instructions.

PyTorch runs a bf16 matmul on CPU through oneDNN, which is fast only where the CPU has AVX512_BF16 or AMX
(or, on ARM, the BF16 extension); elsewhere (an AVX2-only CPU, or oneDNN held below AVX512_CORE_BF16 by
``ONEDNN_MAX_CPU_ISA``) it falls back to code measured 2.6-19x slower than megacann's fp32 route for the
same shapes (``benchmarks/NOTES.md``). There, megacann's bf16 linear layers (``ops.linear``: the column- and
row-parallel projections, implementation ``fp32_gemm``), the fused head loss's logits products
(:mod:`megacann.ops.head_loss`) and the experts' grouped matmuls (:mod:`megacann.ops.moe_gather`) upcast
their bf16 operands, multiply with the fp32 GEMM and round the result to bf16, in the forward and in both
products of the backward (input and weight gradients).

Numerics: a bf16 GEMM on CPU already multiplies exact bf16 values and accumulates in fp32 before one
rounding to bf16, so the two routes differ only in the order of the fp32 sums (and the fp32 route rounds
once per product, as the bf16 one does): results agree within bf16 round-off (tests/test_ops_bf16_matmul.py
states the bound). Memory: the fp32 copies exist only during each product; the autograd graph saves the
bf16 tensors.

``MEGACANN_CPU_BF16_MATMUL=auto|fp32|bf16`` chooses: ``auto`` (default) runs fp32 GEMMs exactly when the
CPU lacks native bf16 GEMM (:func:`native_bf16_gemm`), ``fp32`` always, ``bf16`` never. :func:`forced`
switches it within a block (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator
from typing import Optional

import torch
import torch.nn.functional as F

from megacann.ops import registry
from megacann.ops.isa import cpu_flags
from megacann.ops.weight_grad import defer_or_compute
from megacann.ops.weight_grad import linear as deferrable_linear

ENV = "MEGACANN_CPU_BF16_MATMUL"
CHOICES = ("auto", "fp32", "bf16")
IMPL = "fp32_gemm"  # the registry name of the fp32 route of op ``linear`` (CPU)
PRIORITY = 5
# CPU flags (x86 /proc/cpuinfo ``flags``, ARM ``Features``) of native bf16 matrix arithmetic
NATIVE_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# ONEDNN_MAX_CPU_ISA values that keep oneDNN from its bf16 instructions (x86)
ONEDNN_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})

_FORCED: Optional[bool] = None


def native_bf16_gemm(flags: Iterable[str], onednn_max_isa: Optional[str] = None) -> bool:
    """Whether a CPU with these feature ``flags`` runs bf16 GEMMs natively, given oneDNN's
    ``ONEDNN_MAX_CPU_ISA`` (None or empty: not held)."""
    held = (onednn_max_isa or "").strip().upper() in ONEDNN_WITHOUT_BF16
    return not held and bool(NATIVE_FLAGS & frozenset(flags))


def choose(flags: Iterable[str], onednn_max_isa: Optional[str] = None, setting: Optional[str] = None) -> bool:
    """True: run bf16 matmuls as fp32 GEMMs. ``setting`` is the ``MEGACANN_CPU_BF16_MATMUL`` value
    (None or ``auto``: decide by :func:`native_bf16_gemm`); ValueError naming the variable otherwise."""
    want = (setting or "auto").strip().lower()
    if want not in CHOICES:
        raise ValueError(f"{ENV}={setting!r}: expected one of {CHOICES}")
    if want == "auto":
        return not native_bf16_gemm(flags, onednn_max_isa)
    return want == "fp32"


@functools.lru_cache(maxsize=1)
def _from_environment() -> bool:
    return choose(cpu_flags(), os.environ.get("ONEDNN_MAX_CPU_ISA"), os.environ.get(ENV))


def enabled() -> bool:
    """Whether this process runs CPU bf16 matmuls as fp32 GEMMs (:func:`choose` on this CPU and the
    environment, read once; :func:`forced` overrides it)."""
    return _FORCED if _FORCED is not None else _from_environment()


@contextlib.contextmanager
def forced(on: bool) -> Iterator[None]:
    """Run bf16 matmuls as fp32 GEMMs (``on``) or natively inside the block, whatever the CPU."""
    global _FORCED
    previous, _FORCED = _FORCED, bool(on)
    registry.refresh()
    try:
        yield
    finally:
        _FORCED = previous
        registry.refresh()


def upcasts(*tensors: torch.Tensor) -> bool:
    """Whether a product of these tensors takes the fp32 route: all bf16 on CPU, and :func:`enabled`."""
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors) and enabled()


def gemm_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype to multiply these tensors in: fp32 on the route (:func:`upcasts`), else their own."""
    return torch.float32 if upcasts(*tensors) else tensors[0].dtype


# -- the linear product ------------------------------------------------------------------------------------


class _Fp32Linear(torch.autograd.Function):
    """``F.linear`` of bf16 tensors through fp32 GEMMs; saves the bf16 inputs. A ``deferrable`` weight
    gradient waits for the W pass of a split backward (:mod:`megacann.ops.weight_grad`)."""

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

            def weight_grad() -> tuple[torch.Tensor]:
                return (grad32.t().mm(x.reshape(-1, x.shape[-1]).float()).to(weight.dtype),)

            (grad_w,) = defer_or_compute((ctx.weight,), weight_grad) if ctx.deferrable else weight_grad()
        return grad_x, grad_w, grad_b, None


def fp32_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, deferrable: bool = False
) -> torch.Tensor:
    """``F.linear`` of bf16 CPU tensors computed by fp32 GEMMs (other dtypes: the plain product)."""
    if not (x.dtype == weight.dtype == torch.bfloat16) or (bias is not None and bias.dtype != torch.bfloat16):
        return deferrable_linear(x, weight, bias, deferrable)
    if not torch.is_grad_enabled():
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    deferrable = deferrable and not torch.compiler.is_compiling()
    return _Fp32Linear.apply(x, weight, bias, deferrable)


@registry.register("linear", IMPL, priority=PRIORITY, device_types=("cpu",), available=enabled)
def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, deferrable: bool = False
) -> torch.Tensor:
    return fp32_linear(x, weight, bias, deferrable)
