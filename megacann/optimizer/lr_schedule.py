"""Learning-rate schedule: linear warmup, then cosine / linear decay to ``min_lr_ratio x lr``, or constant."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megacann.config import OptimConfig


@dataclass(frozen=True)
class LRSchedule:
    """``lr_at(step)`` is the learning rate of the optimizer update with 0-based index ``step``."""

    lr: float
    max_steps: int
    warmup_steps: int = 0
    style: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1

    @classmethod
    def from_config(cls, optim: OptimConfig) -> LRSchedule:
        warmup = optim.warmup_steps if optim.warmup_steps is not None else round(optim.warmup_ratio * optim.max_steps)
        return cls(optim.lr, optim.max_steps, warmup, optim.scheduler, optim.min_lr_ratio)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.style == "constant":
            return self.lr
        min_lr = self.lr * self.min_lr_ratio
        decay_steps = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        if self.style == "linear":
            return self.lr - (self.lr - min_lr) * progress
        if self.style == "cosine":
            return min_lr + (self.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"unknown lr schedule {self.style!r}; expected cosine, linear or constant")
