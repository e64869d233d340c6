"""Schedules announce the backward pass of a step's last micro-batch.

Gradient reductions that overlap backward (``distributed.overlap_grad_reduce``) may start a bucket only
once its gradients are final, which is during the backward of the last micro-batch that reaches the
parameters. Every schedule wraps that backward call (per model chunk under interleaving) in
:func:`last_micro_batch_backward`; the gradient buffers ask :func:`is_last_micro_batch_backward` from
their backward hooks. A schedule that never announces it loses the overlap, not correctness: the
reductions then all run when the step's gradients are finalised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_ACTIVE = [False]


@contextmanager
def last_micro_batch_backward(active: bool = True) -> Iterator[None]:
    """Mark the backward run inside this block as the last micro-batch's (``active=False``: a no-op)."""
    previous = _ACTIVE[0]
    _ACTIVE[0] = previous or active
    try:
        yield
    finally:
        _ACTIVE[0] = previous


def is_last_micro_batch_backward() -> bool:
    return _ACTIVE[0]
