"""One AdamW step over flat fp32 buffers, the same update as ``torch.optim.AdamW``.

``reference`` is torch.optim.AdamW's single-tensor update written out (bitwise equal to
``AdamW(foreach=False)``); ``fused`` calls the kernel behind ``AdamW(fused=True)`` (CPU and CUDA), one
pass over the four buffers; the NPU route (:mod:`megacann.ops.npu`) calls torch_npu's ApplyAdamW.
"""

from __future__ import annotations

import torch

from megacann.ops.registry import REFERENCE, register

FUSED = "fused"


@register("adamw_step_", REFERENCE)
def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """Update ``param``, ``exp_avg`` and ``exp_avg_sq`` in place; ``step`` counts from 1 (this update's)."""
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))


def _fused_available() -> bool:
    return hasattr(torch, "_fused_adamw_")


@register("adamw_step_", FUSED, priority=10, device_types=("cpu", "cuda"), available=_fused_available)
def fused_adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    step_tensor = torch.tensor(float(step), dtype=torch.float32, device=param.device)
    torch._fused_adamw_(
        [param],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        [],
        [step_tensor],
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )
