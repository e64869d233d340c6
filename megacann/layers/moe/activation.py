"""The experts' gated activations: SwiGLU, and the clamped SwiGLU of gpt-oss and DeepSeek-V4.

Both read a fused ``gate|up`` projection (the gate in the first half of the last dim, the up projection
in the second, as :func:`megacann.ops.swiglu`), so they work on a tensor-parallel rank's slice alike.
The clamped form bounds the gate above and the up projection on both sides by ``limit``, uses
``gate · sigmoid(alpha · gate)`` for the gate's nonlinearity and shifts the up projection by ``up_shift``:
``(clamp(up, -limit, limit) + up_shift) · g · sigmoid(alpha · g)`` with ``g = min(gate, limit)``.
gpt-oss uses ``alpha`` 1.702 and ``up_shift`` 1; DeepSeek-V4 (``swiglu_limit``) ``alpha`` 1 and
``up_shift`` 0, i.e. ``silu(min(gate, limit)) · clamp(up, ±limit)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megacann import ops

EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float, up_shift: float = 1.0) -> torch.Tensor:
    """The clamped SwiGLU of a fused ``gate|up`` tensor (see the module docstring; the defaults are gpt-oss's)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + up_shift) * gate * torch.sigmoid(alpha * gate)


@dataclass(frozen=True)
class ExpertActivation:
    """Which activation the experts apply: ``kind`` one of :data:`EXPERT_ACTIVATIONS`; ``limit`` and
    ``alpha`` and ``up_shift`` are the clamped SwiGLU's (unused by plain SwiGLU; the defaults are gpt-oss's)."""

    kind: str = "swiglu"
    limit: float = 7.0
    alpha: float = 1.702
    up_shift: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation {self.kind!r} is not one of {EXPERT_ACTIVATIONS}")
        if self.kind == "clamped_swiglu" and self.limit <= 0:
            raise ValueError(f"clamped_swiglu needs a positive limit, got {self.limit}")

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kind == "clamped_swiglu":
            return clamped_swiglu(gate_up, self.limit, self.alpha, self.up_shift)
        return ops.swiglu(gate_up, overwrite_input=True)


SWIGLU = ExpertActivation()  # the default: plain SwiGLU
