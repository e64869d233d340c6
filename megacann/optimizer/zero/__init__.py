"""ZeRO stages 1 and 2 (docs/zero.md): which rank owns which elements (``layout``), the reduce-scattered
gradient buffer (``grad_buffer``), parameters gathered after the update (``param_buffer``), and the
optimizer that drives them (``optimizer``)."""

from megacann.optimizer.zero.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
