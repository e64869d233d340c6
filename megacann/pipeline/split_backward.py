"""A backward in two passes: B, the gradient of a chunk's input, and W, the gradients of its weights.

Zero-bubble schedules send B to the previous stage at once and run W later. The split is generic, not
per layer: B is ``torch.autograd.grad`` of the chunk's outputs with respect to its input, keeping the
graph; W back-propagates the same outputs once more into the chunk's trainable parameters only (autograd
prunes what does not lead to them) and frees the graph. Both passes run the layers' own backward code, so
everything inside a backward works unchanged: tensor- and sequence-parallel collectives, context-parallel
attention, MoE all-to-all and grouped experts, LoRA adapters, activation checkpointing (non-reentrant, which
recomputes once per pass), the optimizer's gradient hooks. B + W gives exactly the fused backward's input
and weight gradients (the same kernels on the same tensors); the price is that W repeats the part of the
backward between the outputs and the weights (about the whole of it), so a split backward costs up to
twice the fused one in compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch


def backward_input(
    outputs: Sequence[torch.Tensor], grad_outputs: Sequence[Optional[torch.Tensor]], inputs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """B: the gradients of ``inputs`` (not accumulated anywhere); the graph is kept for :func:`backward_weight`."""
    return torch.autograd.grad(list(outputs), list(inputs), grad_outputs=list(grad_outputs), retain_graph=True)


def trainable_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def backward_weight(
    outputs: Sequence[torch.Tensor], grad_outputs: Sequence[Optional[torch.Tensor]], params: Sequence[torch.Tensor]
) -> None:
    """W: accumulate the gradients of ``params`` (``.grad`` and the optimizer's hooks, as a fused backward
    does) and free the graph."""
    torch.autograd.backward(list(outputs), grad_tensors=list(grad_outputs), inputs=list(params))
