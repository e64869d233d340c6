"""The C++ CPU kernels of ``csrc/`` as registry implementations (name ``cpp``, device type ``cpu``).

The kernels are torch.library operators (``torch.ops.megacann.*``, schemas in ``csrc/ops.cpp``). This
module adds what makes them first-class PyTorch ops: fake (meta) implementations, so ``torch.compile`` can
trace them, and autograd formulas (``torch.library.register_autograd``) whose backward is again a C++
kernel. The registry's availability check loads the library (:func:`megacann.ops.extension.load`) and
picks the variant of its loops this CPU runs (:mod:`megacann.ops.isa`); if loading fails, the reference
ops run.

Inputs the kernels do not take (fp16, a weight whose dtype differs from the input, rotary tables that
need a gradient) go to the reference implementation.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from megacann.constants import IGNORE_INDEX
from megacann.ops import extension, head_loss, isa, moe_gather, reference
from megacann.ops.moe import _unpermute_reference
from megacann.ops.registry import register

CPP = "cpp"
PRIORITY = 10
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _register_fakes() -> None:
    lib = "megacann::"
    fake = torch.library.register_fake

    @fake(lib + "rms_norm_forward")
    def _(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(
            x.shape[:-1], dtype=_stat_dtype(x)
        )

    @fake(lib + "rms_norm_backward")
    def _(grad, x, weight, rstd):
        return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)

    @fake(lib + "rotary")
    def _(x, cos, sin, interleaved, inverse):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @fake(lib + "swiglu_fused")
    def _(x):
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    @fake(lib + "swiglu_fused_backward")
    def _(grad, x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @fake(lib + "swiglu_fused_backward_")
    def _(grad, x):
        return None

    @fake(lib + "moe_unpermute_backward_")
    def _(grad, permuted, row_id_map, probs):
        return probs.new_empty(probs.shape)

    @fake(lib + "swiglu")
    def _(gate, up):
        return torch.empty_like(gate, memory_format=torch.contiguous_format)

    @fake(lib + "swiglu_backward")
    def _(grad, gate, up):
        return (
            torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format),
        )

    @fake(lib + "cross_entropy_forward")
    def _(logits, target, ignore_index):
        stat = _stat_dtype(logits)
        return logits.new_empty(target.shape, dtype=stat), logits.new_empty(target.shape, dtype=stat)

    @fake(lib + "cross_entropy_backward")
    def _(grad_loss, logits, target, lse, ignore_index):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    @fake(lib + "vocab_shard_stats")
    def _(logits, target, start, valid, ignore_index):
        stat = _stat_dtype(logits)
        return logits.new_empty(target.shape, dtype=stat), logits.new_empty(target.shape, dtype=stat)

    @fake(lib + "vocab_shard_grad_")
    def _(logits, target, lse, grad_loss, start, valid, ignore_index):
        return None

    @fake(lib + "moe_unpermute")
    def _(permuted, row_id_map, probs):
        return permuted.new_empty((probs.shape[0], permuted.shape[1]))

    @fake(lib + "moe_unpermute_backward")
    def _(grad, permuted, row_id_map, probs):
        return torch.empty_like(permuted, memory_format=torch.contiguous_format), torch.empty_like(probs)

    @fake(lib + "grouped_mm_")
    def _(out, a, b, parts):
        return None

    if hasattr(torch.ops.megacann, "decode_attention"):  # a library built before the kernel lacks it

        @fake(lib + "decode_attention")
        def _(q, k_cache, v_cache, attn_mask, scale, sinks):
            return q.new_empty(q.shape, dtype=torch.float32)


def _register_autograd() -> None:
    ops = torch.ops.megacann

    def rms_setup(ctx, inputs, output):
        x, weight, _ = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.mark_non_differentiable(output[1])

    def rms_backward(ctx, grad, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = ops.rms_norm_backward(grad, x, weight, rstd)
        return grad_x, grad_w, None

    torch.library.register_autograd("megacann::rms_norm_forward", rms_backward, setup_context=rms_setup)

    def rotary_setup(ctx, inputs, output):
        _, cos, sin, interleaved, inverse = inputs
        ctx.save_for_backward(cos, sin)
        ctx.flags = (interleaved, inverse)

    def rotary_backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        interleaved, inverse = ctx.flags
        return ops.rotary(grad, cos, sin, interleaved, not inverse), None, None, None, None

    torch.library.register_autograd("megacann::rotary", rotary_backward, setup_context=rotary_setup)

    def fused_setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def fused_backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return ops.swiglu_fused_backward(grad, x)

    torch.library.register_autograd("megacann::swiglu_fused", fused_backward, setup_context=fused_setup)

    def split_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def split_backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return ops.swiglu_backward(grad, gate, up)

    torch.library.register_autograd("megacann::swiglu", split_backward, setup_context=split_setup)

    def ce_setup(ctx, inputs, output):
        logits, target, ignore_index = inputs
        ctx.save_for_backward(logits, target, output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.ignore_index = ignore_index

    def ce_backward(ctx, grad_loss, _grad_lse):
        logits, target, lse = ctx.saved_tensors
        return ops.cross_entropy_backward(grad_loss, logits, target, lse, ctx.ignore_index), None, None

    torch.library.register_autograd("megacann::cross_entropy_forward", ce_backward, setup_context=ce_setup)

    def unpermute_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def unpermute_backward(ctx, grad):
        permuted, row_id_map, probs = ctx.saved_tensors
        grad_permuted, grad_probs = ops.moe_unpermute_backward(grad, permuted, row_id_map, probs)
        return grad_permuted, None, grad_probs

    torch.library.register_autograd("megacann::moe_unpermute", unpermute_backward, setup_context=unpermute_setup)


def available() -> bool:
    """Load the library (installed or built now) and register the Python parts, once."""
    return _ready()


@functools.lru_cache(maxsize=1)
def _ready() -> bool:
    if not extension.load():
        return False
    isa.select()
    _register_fakes()
    _register_autograd()
    return True


def _call(op: Callable, *args: Any) -> Any:
    """``op(*args)``; with gradients off (a generation step) dispatched below autograd, past the Python
    autograd wrapper ``register_autograd`` puts on the op (about 3 us of a small op's 6 us measured)."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _kernel_dtype(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return dtype in KERNEL_DTYPES and all(t.dtype == dtype for t in tensors)


@register("rms_norm", CPP, priority=PRIORITY, device_types=("cpu",), available=available)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _kernel_dtype(x, weight):
        return reference.rms_norm(x, weight, eps)
    return _call(torch.ops.megacann.rms_norm_forward, x, weight, eps)[0]


@register("apply_rotary", CPP, priority=PRIORITY, device_types=("cpu",), available=available)
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if x.dim() != 4 or x.dtype not in KERNEL_DTYPES or cos.requires_grad or sin.requires_grad:
        return reference.apply_rotary(x, cos, sin, interleaved)
    table = torch.float64 if x.dtype == torch.float64 else torch.float32
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return _call(torch.ops.megacann.rotary, x, cos.to(table), sin.to(table), interleaved, False)


# Backward passes that write the input's gradient over the (saved) input, for callers that give the input
# up (``overwrite_input``): one buffer of the input's size less per call. The input's version counter is
# bumped, so any other node that saved the same tensor fails loudly instead of reading gradients.


def _can_overwrite(x: torch.Tensor, in_place_op: str) -> bool:
    """Eager autograd on a contiguous intermediate (never a leaf the user holds, nor inside
    ``torch.compile``, which traces the plain op), with a library that holds ``in_place_op``."""
    return (
        x.requires_grad
        and x.grad_fn is not None
        and x.is_contiguous()
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and hasattr(torch.ops.megacann, in_place_op)
    )


def _given_up(x: torch.Tensor) -> torch.Tensor:
    """``x``, now holding its own gradient: marked modified, returned as a new tensor object."""
    torch.autograd.graph.increment_version(x)
    return x.detach()


class _SwigluOverwritingInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.ops.megacann.swiglu_fused(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        torch.ops.megacann.swiglu_fused_backward_(grad.contiguous(), x)
        return _given_up(x)


class _UnpermuteOverwritingInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, row_id_map, probs):
        ctx.save_for_backward(permuted, row_id_map, probs)
        return torch.ops.megacann.moe_unpermute(permuted, row_id_map, probs)

    @staticmethod
    def backward(ctx, grad):
        permuted, row_id_map, probs = ctx.saved_tensors
        grad_probs = torch.ops.megacann.moe_unpermute_backward_(grad, permuted, row_id_map, probs)
        return _given_up(permuted), None, grad_probs if ctx.needs_input_grad[2] else None


@register("swiglu", CPP, priority=PRIORITY, device_types=("cpu",), available=available)
def swiglu(x: torch.Tensor, up: Optional[torch.Tensor] = None, *, overwrite_input: bool = False) -> torch.Tensor:
    if up is None:
        if x.dtype not in KERNEL_DTYPES:
            return reference.swiglu(x)
        if overwrite_input and _can_overwrite(x, "swiglu_fused_backward_"):
            return _SwigluOverwritingInput.apply(x)
        return _call(torch.ops.megacann.swiglu_fused, x)
    if not _kernel_dtype(x, up) or x.shape != up.shape:
        return reference.swiglu(x, up)
    return _call(torch.ops.megacann.swiglu, x, up)


@register("cross_entropy", CPP, priority=PRIORITY, device_types=("cpu",), available=available)
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    if logits.dtype not in KERNEL_DTYPES:
        return reference.cross_entropy(logits, target, ignore_index)
    return torch.ops.megacann.cross_entropy_forward(logits, target.long(), ignore_index)[0]


def _shard_stats(logits, target, start, valid, ignore_index):
    return torch.ops.megacann.vocab_shard_stats(logits, target, start, valid, ignore_index)


def _shard_grad_(logits, target, lse, grad_loss, start, valid, ignore_index):
    torch.ops.megacann.vocab_shard_grad_(logits, target, lse, grad_loss, start, valid, ignore_index)


CPP_KERNELS = head_loss.ShardKernels(_shard_stats, _shard_grad_)


@register("vocab_parallel_head_loss", CPP, priority=PRIORITY, device_types=("cpu",), available=available)
def vocab_parallel_head_loss(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **kwargs
) -> torch.Tensor:
    kernels = CPP_KERNELS if _kernel_dtype(hidden, weight) else head_loss.TORCH_KERNELS
    return head_loss.head_loss(hidden, weight, target, kernels=kernels, **kwargs)


@register("moe_unpermute", CPP, priority=PRIORITY, device_types=("cpu",), available=available)
def moe_unpermute(
    permuted: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor, *, overwrite_input: bool = False
) -> torch.Tensor:
    """One pass each way instead of a gather, a batched matmul and ``index_add_`` into zeros (equal results:
    the same products summed in the same order, in fp32 for bf16 tokens)."""
    takes = permuted.dim() == 2 and probs.dim() == 2 and row_id_map.dim() == 1
    if not takes or permuted.dtype not in KERNEL_DTYPES or permuted.shape[0] != probs.numel():
        return _unpermute_reference(permuted, row_id_map, probs)
    if overwrite_input and _can_overwrite(permuted, "moe_unpermute_backward_"):
        return _UnpermuteOverwritingInput.apply(permuted, row_id_map, probs)
    return torch.ops.megacann.moe_unpermute(permuted, row_id_map, probs)


def _has_grouped_mm() -> bool:
    """The library loaded and holds the grouped products (a library built before them does not)."""
    return available() and hasattr(torch.ops.megacann, "grouped_mm_")


def _grouped_mm_products(outs: list[torch.Tensor], lefts: list[torch.Tensor], rights: list[torch.Tensor]) -> None:
    if not outs:  # no expert of this rank got a token: the kernel takes no empty list
        return
    torch.ops.megacann.grouped_mm_(outs, [a.detach() for a in lefts], [b.detach() for b in rights], 0)


@register("grouped_matmul", CPP, priority=PRIORITY, device_types=("cpu",), available=_has_grouped_mm)
def grouped_matmul(x: torch.Tensor, weights: list[torch.Tensor], group_sizes: list[int]) -> torch.Tensor:
    """``gather`` (:mod:`megacann.ops.moe_gather`) with the products of each call in one C++ kernel that cuts
    the groups' rows into one piece of equal work per thread, each piece a single-threaded GEMM, instead of
    splitting every product over all threads in turn: one wait on the threads per call instead of one per
    product (level with ``gather`` on a quiet CPU, far faster where other processes share the cores).
    Each output element is the same whole dot product as in ``torch.mm``."""
    return moe_gather.grouped_matmul(x, weights, group_sizes, products=_grouped_mm_products)
