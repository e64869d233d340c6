"""The optimizer the trainer drives: fp32 master weights, loss scaling, global-norm clipping, AdamW.

Model parameters may be bf16/fp16; gradients accumulate in fp32 buffers (``main_grad``); the inner torch
optimizer updates fp32 master copies whose ``.grad`` are those buffer views, and the result is copied
back into the model. In fp32 the master weights are the model's own parameters (no copy).

:class:`OptimizerBase` holds what every optimizer shares (loss scaling, the update skeleton, the LR, the
checkpoint scalars); ZeRO (``megacann.optimizer.zero``) is the other subclass, with sharded state.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megacann.config import MegacannConfig
from megacann.layers.sharding import SHARDING_ATTR
from megacann.optimizer.clip_grads import DUPLICATE_ATTR, clip_grads_, global_grad_norm
from megacann.optimizer.finalize import finalize_model_grads
from megacann.optimizer.grad_buffer import GradBuffers
from megacann.optimizer.loss_scaler import DynamicLossScaler, LossScaler, found_inf_across_ranks
from megacann.optimizer.registry_adamw import RegistryAdamW

_COPIED_ATTRS = (SHARDING_ATTR, DUPLICATE_ATTR)


def no_weight_decay(param: torch.Tensor) -> bool:
    """Biases and norm weights (1-D tensors) are not decayed."""
    return param.dim() < 2


def build_inner_optimizer(
    params: list[torch.nn.Parameter], cfg: MegacannConfig, decays: Optional[list[bool]] = None
) -> torch.optim.Optimizer:
    """AdamW (:class:`RegistryAdamW`: the ops registry's kernel) / torch Adam / SGD over ``params`` with decay
    and no-decay groups; fused kernels when available.
    ``decays[i]`` says whether ``params[i]`` is decayed (default: not :func:`no_weight_decay`)."""
    o = cfg.optim
    if decays is None:
        decays = [not no_weight_decay(p) for p in params]
    decay = [p for p, d in zip(params, decays) if d]
    plain = [p for p, d in zip(params, decays) if not d]
    groups = [
        g
        for g in ({"params": decay, "weight_decay": o.weight_decay}, {"params": plain, "weight_decay": 0.0})
        if g["params"]
    ]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=0.9)
    kwargs: dict[str, Any] = {"lr": o.lr, "betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_eps}
    if o.name == "adamw":  # each tensor's update through the ops registry (torch_npu's kernel on an NPU)
        return RegistryAdamW(groups, **kwargs)
    try:
        return torch.optim.Adam(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError):  # fused kernel not available for this device
        return torch.optim.Adam(groups, foreach=True, **kwargs)


def build_loss_scaler(cfg: MegacannConfig) -> LossScaler:
    if cfg.model.precision == "fp16":
        o = cfg.optim
        return DynamicLossScaler(o.initial_loss_scale, o.loss_scale_window, o.min_loss_scale)
    return LossScaler(1.0)


@dataclass
class StateShard:
    """The optimizer state this rank holds for one parameter, in a layout-free form.

    ``tensors`` are 1-D fp32 *views* of the optimizer's own storage ("master", "exp_avg", "exp_avg_sq"),
    covering elements ``[start, end)`` of the parameter's flattened local tensor-parallel shard (the
    whole shard without ZeRO; this rank's range with ZeRO). Checkpointing reads them to save and copies
    into them to load (then calls ``reload_model_params``), so any layout can save and load any other.
    """

    name: str
    param: torch.nn.Parameter
    start: int
    end: int
    tensors: dict[str, torch.Tensor]


StateAllocator = Callable[[torch.Tensor, str], torch.Tensor]


def _zeros_like(param: torch.Tensor, key: str) -> torch.Tensor:
    return torch.zeros_like(param, memory_format=torch.preserve_format)


def state_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The per-element state tensors ``optimizer`` keeps for each parameter."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return ("exp_avg", "exp_avg_sq")
    if any(group.get("momentum", 0) for group in optimizer.param_groups):
        return ("momentum_buffer",)
    return ()


def init_optimizer_state(optimizer: torch.optim.Optimizer, allocate: StateAllocator = _zeros_like) -> None:
    """Create Adam / SGD state up front (torch creates it lazily at the first step), so checkpoints can
    address it before any step and resumed runs match uninterrupted ones. ``allocate(param, key)`` gives
    each zeroed state tensor (ZeRO hands out views of its flat shard storage)."""
    keys = state_keys(optimizer)
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            if adam:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if group.get("fused") else "cpu")
            for key in keys:
                state[key] = allocate(p, key)


def optimizer_step_count(optimizer: torch.optim.Optimizer) -> int:
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def set_optimizer_step_count(optimizer: torch.optim.Optimizer, step: int) -> None:
    for state in optimizer.state.values():
        if "step" in state:
            state["step"].fill_(step)
    forget = getattr(optimizer, "forget_host_steps", None)  # an optimizer that keeps the counts on the host
    if forget is not None:
        forget()


class OptimizerBase:
    """What every megacann optimizer shares: the trainable parameters, loss scaling, the update skeleton
    (unscale, skip on overflow, clip by the global norm, update, copy to the model), the learning rate and
    the checkpoint scalars. Subclasses decide where gradients, master weights and state live."""

    grad_buffers: GradBuffers
    optimizer: torch.optim.Optimizer  # the inner torch optimizer over fp32 masters (or shards of them)

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], cfg: MegacannConfig):
        self.named_params = [(n, p) for n, p in named_params if p.requires_grad]
        self.model_params = [p for _, p in self.named_params]
        self.bucket_size = int(cfg.distributed.bucket_size_mb * 2**18)  # MB of fp32 -> elements
        self.clip_grad = cfg.optim.clip_grad
        self.loss_scaler = build_loss_scaler(cfg)

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def zero_grad(self) -> None:
        self.grad_buffers.zero()

    def last_micro_batch_backward(self, active: bool = True) -> AbstractContextManager:
        """The block the step's last backward runs in (per model chunk): with ``overlap_grad_reduce`` the
        gradient reductions start there. Schedules take it as ``grad_sync_context``; a custom loop wraps its
        last ``backward()`` in it (optional: without it the reductions run in :meth:`finalize_grads`)."""
        return self.grad_buffers.last_micro_batch_backward(active)

    def finalize_grads(self) -> None:
        """All gradient reductions of a step (data parallel, TP partial sums, tied embeddings)."""
        finalize_model_grads(self.model_params, self.grad_buffers)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm (every element of the model's gradient counted once), a 0-d device tensor."""
        return global_grad_norm(self.model_params)

    def step(self, veto: Optional[Callable[[torch.Tensor], bool]] = None) -> tuple[bool, Optional[torch.Tensor]]:
        """Unscale, skip on overflow, clip, update, copy back. Returns (updated, grad_norm before clipping);
        the norm stays on the device (0-d tensor): a bf16/fp32 step waits for the device only if ``veto``
        reads it (fp16's overflow check must wait: it decides on the host whether to skip).
        ``veto(grad_norm)`` returning True skips the update too (parameters and state untouched); it must
        decide alike on every rank (the norm is global, so a function of it does)."""
        grads = self.grad_buffers.update_grads()
        if self.loss_scaler.dynamic:
            torch._foreach_mul_(grads, 1.0 / self.loss_scaler.scale)
            found_inf = found_inf_across_ranks(grads)
            self.loss_scaler.update(found_inf)
            if found_inf:
                return False, None
        grad_norm = self.grad_norm()
        if veto is not None and veto(grad_norm):
            return False, grad_norm
        clip_grads_(grads, self.clip_grad, grad_norm)
        self.optimizer.step()
        self._copy_master_to_model()
        return True, grad_norm

    def _copy_master_to_model(self) -> None:
        raise NotImplementedError

    def param_tensors(self) -> list[torch.Tensor]:
        """The tensors holding this rank's trainable weights now (for memory accounting)."""
        return list(self.model_params)

    def finish_param_sync(self, params: Optional[list[torch.nn.Parameter]] = None) -> None:
        """Wait until the model's parameters hold the last update (ZeRO may still be gathering them after
        the step with ``overlap_param_gather``). Code reading parameters outside a forward calls this."""

    # -- checkpointing ------------------------------------------------------------------------------
    def state_shards(self) -> list[StateShard]:
        """Every parameter's optimizer state held here (views; see :class:`StateShard`)."""
        raise NotImplementedError

    def scalar_state(self) -> dict[str, Any]:
        """Layout-free scalars: the update count and the loss scaler."""
        return {"step": optimizer_step_count(self.optimizer), "loss_scaler": self.loss_scaler.state_dict()}

    def load_scalar_state(self, state: dict[str, Any]) -> None:
        set_optimizer_step_count(self.optimizer, state["step"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])

    def reload_model_params(self) -> None:
        """After master weights were loaded in place, bring the model's (low-precision) copies in line."""
        self._copy_master_to_model()


class MixedPrecisionOptimizer(OptimizerBase):
    """Optimizer over all trainable parameters of this rank (no sharding across data parallelism)."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        cfg: MegacannConfig,
        grad_buffers: Optional[GradBuffers] = None,
    ):
        super().__init__(named_params, cfg)
        self.grad_buffers = grad_buffers or GradBuffers(
            self.model_params, self.bucket_size, overlap=cfg.distributed.overlap_grad_reduce
        )
        self._build_update(cfg)

    def _build_update(self, cfg: MegacannConfig) -> None:
        """The fp32 masters and the inner optimizer with its state (on the device; offload overrides it)."""
        self.master_params = [self._master_of(p) for p in self.model_params]
        self.optimizer = build_inner_optimizer(self.master_params, cfg)
        init_optimizer_state(self.optimizer)

    @staticmethod
    def _master_of(param: torch.nn.Parameter) -> torch.nn.Parameter:
        if param.dtype == torch.float32:
            return param
        master = torch.nn.Parameter(param.detach().float().clone())
        master.grad = param.main_grad
        for attr in _COPIED_ATTRS:
            if hasattr(param, attr):
                setattr(master, attr, getattr(param, attr))
        master.main_grad = param.main_grad
        return master

    @torch.no_grad()
    def _copy_master_to_model(self) -> None:
        pairs = [(p, m) for p, m in zip(self.model_params, self.master_params) if p is not m]
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    # -- checkpointing ------------------------------------------------------------------------------
    def state_shards(self) -> list[StateShard]:
        """Every parameter's optimizer state held here (views; see :class:`StateShard`)."""
        shards = []
        for (name, param), master in zip(self.named_params, self.master_params):
            state = self.optimizer.state[master]
            tensors = {"master": master.detach().view(-1)}
            for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                if key in state:
                    tensors[key] = state[key].view(-1)
            shards.append(StateShard(name, param, 0, param.numel(), tensors))
        return shards

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "master_params": [m.detach() for p, m in zip(self.model_params, self.master_params) if p is not m],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        masters = [m for p, m in zip(self.model_params, self.master_params) if p is not m]
        with torch.no_grad():
            for m, saved in zip(masters, state["master_params"]):
                m.copy_(saved)
        self._copy_master_to_model()
