"""A backward in two passes: B, the gradient of a chunk's input, and W, the gradients of its weights.

Zero-bubble schedules send B to the previous stage at once and run W later. B back-propagates the chunk's
outputs once, through every layer's own backward (tensor-, sequence- and context-parallel collectives,
MoE all-to-all, activation checkpointing's recompute), and frees the graph as it goes. While it runs, a
:class:`~megacann.ops.weight_grad.WeightGradStore` collects: the products with large weights (linear,
embedding, grouped experts, LoRA adapters, the fused head loss; :mod:`megacann.ops.weight_grad`) compute
their input's gradient only and leave a closure over the tensors their weight gradient needs. The layers
know nothing of this: :func:`prepare_split_backward` marks the model chunks' weights, whose products then
defer (:func:`megacann.ops.weight_grad.deferrable`), and every other product is the plain one. The other
parameters (norms, the router, biases, anything inside ``torch.compile``) get their
gradients computed in B, held without being accumulated. W runs the closures and accumulates every
gradient into its parameter in one autograd call, so ``.grad``, gradient buffers and the optimizer's
hooks see what a fused backward gives them, and only then. B + W costs what the fused backward does.

A W whose B never ran (the first stage's chunk has no input to differentiate) is the fused backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

import torch

from megacann.ops.weight_grad import WeightGradStore, collecting, mark_deferrable

_PENDING = "_megacann_pending_weight_grads"  # set on a chunk's first output between its B and its W
_PREPARED = "_megacann_prepared_for_split_backward"  # set on a chunk by prepare_split_backward


def _mark_weights(chunk: torch.nn.Module, args) -> None:
    for param in trainable_parameters(chunk):
        mark_deferrable(param)


def prepare_split_backward(chunks: Iterable[torch.nn.Module]) -> None:
    """Let the products of ``chunks``' trainable weights leave their gradients to :func:`backward_weight`:
    the weights are marked (:func:`megacann.ops.weight_grad.mark_deferrable`) before each forward, so
    adapters attached after this call are too. Preparing a chunk twice changes nothing."""
    for chunk in chunks:
        if not hasattr(chunk, _PREPARED):
            setattr(chunk, _PREPARED, True)
            chunk.register_forward_pre_hook(_mark_weights)


def trainable_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def graph_leaves(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors requiring a gradient that ``outputs`` were computed from (their autograd graph's
    gradient accumulators), in the order first reached."""
    leaves: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            leaves.append(variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def backward_input(
    outputs: Sequence[torch.Tensor], grad_outputs: Sequence[Optional[torch.Tensor]], inputs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """B: the gradients of ``inputs`` (not accumulated anywhere). The weight gradients wait in a store
    attached to ``outputs`` for :func:`backward_weight`; the graph is freed."""
    wanted = {id(t) for t in inputs}
    params = [t for t in graph_leaves(outputs) if id(t) not in wanted]
    store = WeightGradStore()
    setattr(outputs[0], _PENDING, store)
    if not inputs and not params:
        return ()
    with collecting(store):
        grads = torch.autograd.grad(
            list(outputs), [*inputs, *params], grad_outputs=list(grad_outputs), allow_unused=True
        )
    input_grads, param_grads = grads[: len(inputs)], grads[len(inputs) :]
    unused = [i for i, g in enumerate(input_grads) if g is None]
    if unused:
        raise RuntimeError(f"split backward: inputs {unused} of the chunk do not reach its outputs")
    for param, grad in zip(params, param_grads):
        if grad is not None:
            store.add_grad(param, grad)
    return tuple(input_grads)


def backward_weight(
    outputs: Sequence[torch.Tensor], grad_outputs: Sequence[Optional[torch.Tensor]], params: Sequence[torch.Tensor]
) -> None:
    """W: accumulate the weight gradients B left (``.grad`` and the optimizer's hooks, as a fused backward
    does); without a B before it, the fused backward into ``params``."""
    store: Optional[WeightGradStore] = getattr(outputs[0], _PENDING, None)
    if store is None:
        torch.autograd.backward(list(outputs), grad_tensors=list(grad_outputs), inputs=list(params))
        return
    delattr(outputs[0], _PENDING)
    store.run()
