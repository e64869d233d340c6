"""Implementations of ``adamw_step_`` (declared in :mod:`megacann.ops.signatures`): one AdamW step over
flat fp32 buffers, the same update as ``torch.optim.AdamW``.

``reference`` is torch.optim.AdamW's single-tensor update written out (bitwise equal to
``AdamW(foreach=False)``); ``fused`` calls the kernel behind ``AdamW(fused=True)`` (CPU and CUDA), one
pass over the four buffers; the NPU route (:mod:`megacann.ops.npu`) calls torch_npu's ApplyAdamW.
"""

from __future__ import annotations

import torch

from megacann.ops.registry import REFERENCE, register

FUSED = "fused"


@register("adamw_step_", REFERENCE)
def adamw_step_(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step) -> None:
    """torch.optim.AdamW's single-tensor update, in place."""
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
def fused_adamw_step_(param, grad, exp_avg, exp_avg_sq, *, step, **hyper) -> None:
    """``hyper`` (lr, beta1, beta2, eps, weight_decay) goes to the kernel under the same names."""
    step_tensor = torch.tensor(float(step), dtype=torch.float32, device=param.device)
    torch._fused_adamw_(
        [param], [grad], [exp_avg], [exp_avg_sq], [], [step_tensor], amsgrad=False, maximize=False, **hyper
    )
