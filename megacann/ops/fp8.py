"""``fp8_linear``: a linear layer whose three products run on FP8 operands (:mod:`~megacann.ops.fp8_formats`).

Forward ``y = x @ w.T`` with ``x`` and ``w`` in the forward format (e4m3); backward ``dx = dy @ w`` and
``dw = dy.T @ x`` with ``dy`` in the gradient format (e5m2 by default) and ``x`` / ``w`` quantised again
along the reduction dimension of each product, from the high-precision tensors saved by the forward
(rowwise, blockwise and MX scales run along the reduction dimension, which differs per product). The bias
and the accumulation stay in fp32; the result has ``x``'s dtype.

Under tensor parallelism the layer says how its weight is split (``parallel``: ``column`` splits the
output features, ``row`` the input features) and over which ``group``; each operand's blocks that span a
split dimension get their amax reduced over that group, so every layout quantises exactly as one process.
Under context parallelism the tokens (the rows of ``x`` and of the output gradient) are split over a
``token_group``: a block spanning the tokens (every tensorwise scale, the rows of the weight gradient's
operands under rowwise) has its amax reduced over that group too; 1 x N tiles along the tokens need none.

Two ways to run the products, registered as implementations of the op: ``reference`` (dequantise, fp32
GEMM: exact to the format, any device) and ``scaled_mm`` (``torch._scaled_mm`` on the FP8 data with the
scales, for the tensorwise and rowwise recipes; the others go the reference way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megacann.ops.fp8_formats import (
    AmaxGroups,
    Fp8Error,
    Quantized,
    block_shape,
    measured_amax,
    power_of_two_scales,
    quantize,
)
from megacann.ops.registry import REFERENCE, register, resolve, selected
from megacann.ops.weight_grad import defer_or_compute, deferrable

# which dimension of each product's operand view ([rows, reduction]) is split over the group
_SPLIT_DIMS = {
    # product: (A's split dim, B's split dim) for A @ B.T
    "column": {"forward": (None, 0), "input_grad": (1, 1), "weight_grad": (0, None)},
    "row": {"forward": (1, 1), "input_grad": (None, 0), "weight_grad": (None, 0)},
    None: {"forward": (None, None), "input_grad": (None, None), "weight_grad": (None, None)},
}
# which dimension of each product's operand view holds the tokens (split over a token group)
_TOKEN_DIMS = {"forward": (0, None), "input_grad": (0, None), "weight_grad": (1, 1)}
_ROLES = {
    "forward": ("activation", "weight"),
    "input_grad": ("gradient", "weight"),
    "weight_grad": ("gradient", "activation"),
}
# the operands whose tensorwise amax a delayed-scaling history keeps: (A, B) of each product
X, W, DY = 0, 1, 2
_OPERANDS = {"forward": (X, W), "input_grad": (DY, W), "weight_grad": (DY, X)}
SCALED_MM_RECIPES = ("tensorwise", "rowwise")
SCALINGS = ("current", "delayed")

Gemm = Callable[[Quantized, Quantized], torch.Tensor]


def _operand_group(block, split_dim: Optional[int], group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The group to reduce an operand's amax over: only when a block spans the split dimension whole."""
    if split_dim is None or group is None:
        return None
    return group if block[split_dim] is None else None


def _token_group(block, token_dim: Optional[int], token_group: Optional[dist.ProcessGroup]):
    """The group to reduce an operand's amax over for its tokens: when a block spans the tokens whole."""
    if token_dim is None or token_group is None:
        return None
    return token_group if block[token_dim] is None else None


def _delayed_amax(t, operand: int, history: torch.Tensor, group, record: bool) -> torch.Tensor:
    """Delayed scaling of a tensorwise operand: record this use's amax in row 0 of ``history`` (the step's
    maximum so far) and return the earlier steps' maximum (rows 1..), or this amax while they are all 0."""
    measured = measured_amax(t, (t.shape[0], t.shape[1]), group)
    if record:
        history[0, operand] = torch.maximum(history[0, operand], measured.reshape(()))
    past = history[1:, operand].max()
    return torch.where(past > 0, past, measured.reshape(())).reshape(1, 1)


def quantize_operand(
    t,
    product: str,
    side: int,
    recipe: str,
    fmt: str,
    parallel,
    group,
    history=None,
    record=True,
    tokens=None,
    amax=None,
) -> Quantized:
    """Operand ``side`` (0: A, 1: B) of ``product`` (``A @ B.T``) in FP8 by the recipe's block for its role,
    its amax reduced over the groups that hold other pieces of its blocks (the split dimension's ``group``,
    the tokens' ``tokens``), from ``history`` under delayed scaling, or the given per-block ``amax``."""
    role = _ROLES[product][side]
    split = _SPLIT_DIMS[parallel][product][side]
    block = block_shape(recipe, role)
    groups = (_operand_group(block, split, group), _token_group(block, _TOKEN_DIMS[product][side], tokens))
    amax_group = tuple(g for g in groups if g is not None) or None
    if amax is None and history is not None:
        amax = _delayed_amax(t, _OPERANDS[product][side], history, amax_group, record)
    return quantize(
        t,
        fmt,
        block,
        power_of_two=power_of_two_scales(recipe),
        amax_group=amax_group,
        amax=amax,
        pad=(split != 0, split != 1),  # a split dimension must hold whole blocks on every rank
        what=f"fp8_linear {product} operand {'AB'[side]} ({role})",
    )


def quantize_pair(
    a, b, product: str, recipe: str, formats: tuple[str, str], parallel, group, history=None, record=True, tokens=None
) -> tuple[Quantized, Quantized]:
    """Both operands of ``product`` (:func:`quantize_operand`), A first (the order of their collectives)."""
    qa = quantize_operand(a, product, 0, recipe, formats[0], parallel, group, history, record, tokens)
    qb = quantize_operand(b, product, 1, recipe, formats[1], parallel, group, history, record, tokens)
    return qa, qb


def shared_token_amax(
    x2: torch.Tensor, recipe: str, token_group: AmaxGroups, history=None, record=True
) -> Optional[torch.Tensor]:
    """The forward's activation ``x2`` holds this rank's tokens of an input whose pieces are multiplied one by
    one (the tp-overlapped projection): the amax its blocks spanning the tokens share, the maximum over
    ``token_group`` (from ``history`` under delayed scaling), so each piece is scaled as the whole; None
    where the recipe's activation blocks hold single tokens (each piece then scales itself alike)."""
    block = block_shape(recipe, "activation")
    if block[0] is not None:
        return None
    if history is not None:
        return _delayed_amax(x2, X, history, token_group, record)
    return measured_amax(x2, (x2.shape[0], x2.shape[1] if block[1] is None else block[1]), token_group)


def reference_gemm(a: Quantized, b: Quantized) -> torch.Tensor:
    """``A @ B.T`` of the dequantised operands in fp32."""
    return a.dequantize() @ b.dequantize().t()


def scaled_mm_gemm(a: Quantized, b: Quantized) -> torch.Tensor:
    """``A @ B.T`` by ``torch._scaled_mm`` with per-tensor or per-row scales."""
    return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale, scale_b=b.scale.t(), out_dtype=torch.float32)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x2, weight, bias, recipe, forward_format, grad_format, parallel, group, gemm, history, tokens, defer
    ):
        # evaluation (no autograd) scales by the history without adding to it
        formats = (forward_format, forward_format)
        xq, wq = quantize_pair(
            x2, weight, "forward", recipe, formats, parallel, group, history, torch.is_grad_enabled(), tokens
        )
        y = gemm(xq, wq)
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x2, weight)
        ctx.weight, ctx.defer = weight, defer  # a split backward's W differentiates into ``weight``
        ctx.options = (recipe, forward_format, grad_format, parallel, group, gemm, bias is not None, history, tokens)
        return y.to(x2.dtype)

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        recipe, forward_format, grad_format, parallel, group, gemm, has_bias, history, tokens = ctx.options
        dy2 = dy
        formats = (grad_format, forward_format)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            a, b = quantize_pair(dy2, weight.t(), "input_grad", recipe, formats, parallel, group, history, True, tokens)
            dx = gemm(a, b).to(x2.dtype)
        if ctx.needs_input_grad[1]:

            def weight_grad(dtype=weight.dtype):
                a, b = quantize_pair(
                    dy2.t(), x2.t(), "weight_grad", recipe, formats, parallel, group, history, True, tokens
                )
                return (gemm(a, b).to(dtype),)

            (dw,) = defer_or_compute((ctx.weight,), weight_grad) if ctx.defer else weight_grad()
        if has_bias and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0).to(dy.dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None


def check_parallel(parallel: Optional[str]) -> None:
    if parallel not in _SPLIT_DIMS:
        raise Fp8Error(f"fp8_linear: parallel must be 'column', 'row' or None, got {parallel!r}")


def check_history(recipe: str, history: Optional[torch.Tensor]) -> None:
    if history is None:
        return
    if recipe != "tensorwise":
        raise Fp8Error(f"fp8_linear: delayed scaling (amax_history) takes the tensorwise recipe, not {recipe!r}")
    if history.dim() != 2 or history.shape[0] < 2 or history.shape[1] != 3:
        raise Fp8Error(f"fp8_linear: amax_history must be [1 + history length, 3], got {tuple(history.shape)}")


def run_with_gemm(x, weight, bias, recipe, forward_format, grad_format, parallel, group, history, gemm, tokens=None):
    check_parallel(parallel)
    check_history(recipe, history)
    x2 = x.reshape(-1, x.shape[-1])
    # under a split backward (zb1p, zbv, dualpipev) the weight-gradient product waits for the W pass
    options = (recipe, forward_format, grad_format, parallel, group, gemm, history, tokens, deferrable(weight))
    y = _Fp8Linear.apply(x2, weight, bias, *options)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def implementation(gemm_for: Callable[[str], Gemm]) -> Callable[..., torch.Tensor]:
    """An implementation of the ``fp8_linear`` op (its declared signature) whose products run by
    ``gemm_for(recipe)``: the implementations differ only in their GEMM."""

    def fp8_linear(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        recipe: str = "tensorwise",
        forward_format: str = "e4m3",
        grad_format: str = "e5m2",
        parallel: Optional[str] = None,
        group: Optional[dist.ProcessGroup] = None,
        amax_history: Optional[torch.Tensor] = None,
        token_group: Optional[dist.ProcessGroup] = None,
    ) -> torch.Tensor:
        options = (recipe, forward_format, grad_format, parallel, group, amax_history)
        return run_with_gemm(x, weight, bias, *options, gemm_for(recipe), token_group)

    fp8_linear.gemm_for = gemm_for  # type: ignore[attr-defined]  # for products the op's autograd does not run
    return fp8_linear


def selected_gemm(recipe: str, device_type: str) -> Gemm:
    """The GEMM by which the ``fp8_linear`` implementation selected for ``device_type`` multiplies ``recipe``'s
    products: for FP8 products arranged elsewhere (the tp-overlapped projection's chunks)."""
    gemm_for = getattr(resolve("fp8_linear", device_type), "gemm_for", None)
    if gemm_for is None:
        raise Fp8Error(
            f"fp8_linear's implementation {selected('fp8_linear', device_type)!r} on {device_type} was not built by "
            "megacann.ops.fp8.implementation, so the tp-overlapped projection cannot multiply by its GEMM"
        )
    return gemm_for(recipe)


def _scaled_mm_for(recipe: str) -> Gemm:
    return scaled_mm_gemm if recipe in SCALED_MM_RECIPES else reference_gemm


def _has_scaled_mm() -> bool:
    return hasattr(torch, "_scaled_mm")


fp8_linear = register("fp8_linear", REFERENCE)(implementation(lambda recipe: reference_gemm))
fp8_linear_scaled_mm = register(
    "fp8_linear", "scaled_mm", priority=10, device_types=("cpu", "cuda"), available=_has_scaled_mm
)(implementation(_scaled_mm_for))


@dataclass(frozen=True)
class Fp8Settings:
    """How a layer runs its product in FP8 (``precision.fp8`` and its keys): the recipe, the output
    gradient's format, which transformer blocks keep plain products (the first and last few of
    ``num_layers``: the blocks most sensitive to quantisation), and the scaling."""

    recipe: str
    grad_format: str = "e5m2"
    exclude_first_layers: int = 0
    exclude_last_layers: int = 0
    num_layers: Optional[int] = None
    scaling: str = "current"  # current | delayed (tensorwise: scales from the amax of earlier steps)
    amax_history_len: int = 16
    # context parallelism: the group over which every layer's tokens are split (None: not split)
    token_group: Optional[dist.ProcessGroup] = field(default=None, compare=False)

    def new_history(self, device=None) -> Optional[torch.Tensor]:
        """A layer's delayed-scaling buffer (``fp8_linear``'s ``amax_history``), or None for current scaling."""
        if self.scaling == "current":
            return None
        return torch.zeros(1 + self.amax_history_len, 3, dtype=torch.float32, device=device)

    def covers_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` (global index) runs its linear layers in FP8."""
        if layer_id < self.exclude_first_layers:
            return False
        return self.num_layers is None or layer_id < self.num_layers - self.exclude_last_layers
