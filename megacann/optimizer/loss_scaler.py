"""Loss scaling for fp16: dynamic (grow after a window of clean steps, halve on overflow) or constant 1."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


class LossScaler:
    """A constant scale (1.0 for bf16 / fp32: nothing to do)."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler(LossScaler):
    """Halve the scale on an overflowing step (the step is skipped); double it after ``window`` clean steps."""

    dynamic = True

    def __init__(self, initial_scale: float = 2.0**16, window: int = 1000, min_scale: float = 1.0):
        super().__init__(initial_scale)
        self.window = window
        self.min_scale = min_scale
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.min_scale, self.scale / 2.0)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale *= 2.0
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state.get("clean_steps", 0))


def found_inf_across_ranks(grads: Iterable[torch.Tensor]) -> bool:
    """True when any of ``grads`` on any rank is not finite (agreed across the whole world, so every rank
    skips the same steps whichever part of the gradients it holds)."""
    grads = list(grads)
    device = grads[0].device if grads else torch.device("cpu")
    found = torch.zeros(1, device=device)
    for grad in grads:
        if not torch.isfinite(grad).all():
            found.fill_(1.0)
            break
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item() > 0)
