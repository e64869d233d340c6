"""Deferred weight gradients: what the input-gradient pass (B) of a split backward leaves for the weight pass (W).

Zero-bubble pipeline schedules split a backward in two: B computes the gradient of a model chunk's input,
which the previous stage waits for, and W the gradients of its weights, which nobody waits for. The
layers with large weights (linear, embedding, grouped experts) compute only their input's gradient while a
:class:`WeightGradStore` collects (:func:`collecting`); each pushes a closure holding what its weight
gradient needs (the saved input, the output gradient) and :meth:`WeightGradStore.run` computes them later.
This is the design of the zero-bubble paper and of Megatron's ``WeightGradStore``: W repeats nothing of B.

W accumulates through autograd, in one engine call, so parameters receive their gradients exactly as a
fused backward gives them: ``.grad`` (or the buffer view it aliases), views and casts of a weight
differentiated back to the parameter, each parameter's post-accumulate-grad hooks (the optimizer's
gradient buffers, ZeRO) fired once, with contributions of a weight used twice summed first.

Outside a split backward nothing is collected: the same autograd functions compute every gradient at
once. The layers do not choose: :func:`linear` and :func:`embedding` build the deferrable products for
weights marked by :func:`mark_deferrable` (the split backward marks the weights of the model chunks it
serves, :func:`megacann.pipeline.split_backward.prepare_split_backward`), or computed from such a weight in
a few autograd steps (a view, LoRA's B laid out); the plain ``F.linear`` / ``F.embedding`` otherwise and
inside ``torch.compile`` (a compiled graph's backward is one piece; its weight gradients come with B). The
choice follows the weight, so a checkpointed region's recompute builds the products its forward built.
Plain products cost less in an ordinary backward: activation checkpointing stops its recompute before the
last product of a region, which it cannot do for an autograd function (5 to 7 % of a LLaMA chunk's
backward under ``full`` recompute, benchmarks/split_backward.py).

A weight whose storage is freed between B and W (ZeRO-3 frees a unit's gathered weights once its backward
has passed) is marked with :func:`mark_released_after_backward`; a W that reads the weight again (the fused
head loss recomputes its logits) computes that gradient in B instead (:func:`kept_until_w`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megacann.ops import weight_copies

Compute = Callable[[], Sequence[Optional[torch.Tensor]]]

_ACTIVE: Optional[WeightGradStore] = None  # a module global, not per thread: backward may run on the engine's
_DEFERRABLE = "_megacann_deferrable"  # set on weights whose products may leave their gradient to W
_SEARCH_STEPS = 8  # how many autograd nodes back a computed weight is traced to a marked one
# the nodes it is traced through: views, casts and layouts, which save no tensor B would free before W
_VIEW_NODES = ("Alias", "AsStrided", "Expand", "Narrow", "Permute", "Reshape", "ReshapeAlias", "Select", "Slice")
_LAYOUT_NODES = frozenset(
    _VIEW_NODES
    + ("Squeeze", "T", "Transpose", "Unsqueeze", "UnsafeView", "View")
    + ("Cat", "Clone", "ConstantPadNd", "Split", "SplitWithSizes", "ToCopy")
)
_RELEASED = "_megacann_released_after_backward"  # set on weights whose storage is freed between B and W
_STATS = {"deferred": 0, "run": 0, "held": 0}  # closures deferred, closures run, gradients B computed for W


class WeightGradStore:
    """The weight gradients one B deferred: closures (with the weights they belong to) and gradients that
    B computed but did not accumulate (small parameters)."""

    def __init__(self) -> None:
        self._closures: list[tuple[tuple[torch.Tensor, ...], Compute]] = []
        self._grads: list[tuple[torch.Tensor, torch.Tensor]] = []

    def defer(self, weights: Sequence[torch.Tensor], compute: Compute) -> None:
        """Run ``compute()`` in W; it returns the gradients of ``weights`` (same order, None for none)."""
        self._closures.append((tuple(weights), _counted(compute)))
        _STATS["deferred"] += 1

    def add_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """A gradient already computed, to accumulate into ``param`` in W."""
        self._grads.append((param, grad))
        _STATS["held"] += 1

    def __len__(self) -> int:
        return len(self._closures) + len(self._grads)

    @property
    def num_closures(self) -> int:
        return len(self._closures)

    def run(self) -> None:
        """W: compute the deferred gradients and accumulate them all into their parameters (one engine call:
        each closure's gradients reach their parameters as soon as it has run)."""
        pending = list(self._closures)
        if self._grads:
            held = [g for _, g in self._grads]
            pending.append((tuple(p for p, _ in self._grads), lambda: held))
        self._closures, self._grads = [], []
        if not pending:
            return
        with torch.enable_grad():
            roots = [_RunDeferred.apply(compute, *weights) for weights, compute in pending]
        torch.autograd.backward(roots)  # scalar roots: no gradient tensors to check


class _RunDeferred(torch.autograd.Function):
    """A node whose backward runs one deferred closure and hands its results to the weights' gradient edges."""

    @staticmethod
    def forward(ctx, compute, *weights):
        ctx.compute = compute
        return weights[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        compute, ctx.compute = ctx.compute, None  # free the saved tensors once used
        return (None, *compute())


def active_store() -> Optional[WeightGradStore]:
    """The store collecting deferred weight gradients now (inside a split backward's B), else None."""
    return _ACTIVE


@contextmanager
def collecting(store: WeightGradStore) -> Iterator[WeightGradStore]:
    """Defer weight gradients into ``store`` within the block (B of a split backward)."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, store
    try:
        yield store
    finally:
        _ACTIVE = previous


def mark_deferrable(weight: torch.Tensor) -> None:
    """Let products of ``weight`` (and of tensors computed from it) leave its gradient to a split backward's W."""
    setattr(weight, _DEFERRABLE, True)


def deferrable(weight: torch.Tensor) -> bool:
    """Whether a product of ``weight`` built now may leave its gradient to W: autograd on, not compiling, and
    ``weight`` marked (:func:`mark_deferrable`) or laid out from a marked weight in a few autograd steps
    (views, casts, slices, concatenation, padding: W differentiates back through them, B freed nothing of
    theirs); a weight computed otherwise (``w * scale``) gets the plain product."""
    if not weight.requires_grad or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    if weight.grad_fn is None:
        return getattr(weight, _DEFERRABLE, False)
    nodes, steps = [weight.grad_fn], 0
    while nodes and steps < _SEARCH_STEPS:
        node, steps = nodes.pop(), steps + 1
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node: its parameter
        if leaf is not None and getattr(leaf, _DEFERRABLE, False):
            return True
        if type(node).__name__.rstrip("0123456789").removesuffix("Backward") in _LAYOUT_NODES:
            nodes.extend(n for n, _ in node.next_functions if n is not None)
    return False


def mark_released_after_backward(weight: torch.Tensor) -> None:
    """Say that ``weight``'s storage is freed once the backward has passed it (before a split backward's W)."""
    setattr(weight, _RELEASED, True)


def kept_until_w(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is still readable when W runs (not marked by :func:`mark_released_after_backward`)."""
    return not getattr(weight, _RELEASED, False)


def weight_grad_stats() -> dict[str, int]:
    """How many weight-gradient closures this process deferred and ran, and how many gradients B computed and
    held for W to accumulate (tests prove the split with it)."""
    return dict(_STATS)


def defer_or_compute(weights: Sequence[torch.Tensor], compute: Compute) -> tuple[Optional[torch.Tensor], ...]:
    """In B, defer ``compute`` and return Nones for the weights; otherwise compute their gradients now."""
    store = _ACTIVE
    if store is None:
        return tuple(compute())
    store.defer(weights, compute)
    return (None,) * len(weights)


# -- linear and embedding with a deferrable weight gradient ---------------------------------------------


def _counted(compute: Compute) -> Compute:
    def run() -> Sequence[Optional[torch.Tensor]]:
        _STATS["run"] += 1
        return compute()

    return run


def _linear_weight_grad(grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor]:
    return (grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])),)


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.weight = weight  # the tensor W differentiates into (a parameter, or a view or cast of one)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.reshape(-1, grad.shape[-1]).mm(weight).view(x.shape)
        if ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        if ctx.needs_input_grad[1]:
            (grad_w,) = defer_or_compute((ctx.weight,), lambda: _linear_weight_grad(grad, x))
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear``; for a :func:`deferrable` weight, its gradient waits for W when the backward is split (the
    bias gradient, small, comes with B). Otherwise the plain ``F.linear``."""
    out = weight_copies.product(x, weight, bias)  # a generate call's product (megacann.ops.weight_copies)
    if out is not None:
        return out
    if not deferrable(weight):
        return F.linear(x, weight, bias)
    return _DeferrableLinear.apply(x, weight, bias)


class _DeferrableEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.num_weights = weight, weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        num = ctx.num_weights
        (grad_w,) = defer_or_compute(
            (ctx.weight,), lambda: (torch.ops.aten.embedding_backward(grad, ids, num, -1, False, False),)
        )
        return None, grad_w


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding`` (no padding index); for a :func:`deferrable` weight, its gradient waits for W when the
    backward is split."""
    if not deferrable(weight):
        return F.embedding(ids, weight)
    return _DeferrableEmbedding.apply(ids, weight)
