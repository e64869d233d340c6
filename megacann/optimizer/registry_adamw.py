"""AdamW whose update goes through the ops registry (:func:`megacann.ops.adamw_step_`), one call per tensor.

So the trainer's step runs the device's own AdamW kernel where the registry has one (torch_npu's ApplyAdamW
on an NPU; on CPU and CUDA the kernel behind ``torch.optim.AdamW(fused=True)``, the same arithmetic as
before), and the PyTorch reference where ``precision.fused_ops`` leaves ``adamw_step_`` out. The state
(``step``, ``exp_avg``, ``exp_avg_sq``), the param groups and the state dict are torch.optim.AdamW's, so
checkpoints, ZeRO's state views and the offloaded update work as with the torch class (it is a subclass).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch

from megacann import ops


class RegistryAdamW(torch.optim.AdamW):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction), each tensor's step by
    :func:`megacann.ops.adamw_step_`. amsgrad, maximize and capturable are not offered."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        # each tensor's step count as a Python int, so a step reads no tensor (the ``step`` tensors stay the
        # state dict's); read once after the state is made or written from outside (forget_host_steps)
        self._host_steps: dict[torch.Tensor, int] = {}

    def forget_host_steps(self) -> None:
        """Read the ``step`` tensors again at the next step: call after writing them in place."""
        self._host_steps.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.forget_host_steps()
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("RegistryAdamW: amsgrad and maximize are not supported")
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:  # as torch creates it (megacann's init_optimizer_state usually has already)
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if state["step"].device.type != "cpu":  # (a state dict saved by a fused torch AdamW)
                    state["step"] = state["step"].cpu()
                step = self._host_steps.get(param)
                step = (int(state["step"]) if step is None else step) + 1
                self._host_steps[param] = step
                state["step"].fill_(step)
                ops.adamw_step_(
                    param,
                    param.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    lr=float(group["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=step,
                )
        return loss
