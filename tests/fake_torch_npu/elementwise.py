"""The element-wise and per-row kernels: ``npu_rms_norm``, ``npu_rotary_mul`` (with and without
``rotary_mode``), ``npu_swiglu``, ``npu_cross_entropy_loss`` and ``npu_apply_adam_w``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .contract import FLOAT_DTYPES, MAX_CE_ROWS, Release


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x):
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def kernels(npu, release: Release) -> list:
    """The kernels of ``release`` (its ``npu_rotary_mul`` with or without ``rotary_mode``)."""

    def npu_rms_norm(self, gamma, epsilon=1e-6):
        assert self.dtype in FLOAT_DTYPES and gamma.shape == self.shape[-1:], "gamma must match the last dim"
        xf = self.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(self.dtype), rstd

    def _rotary(x, r1, r2, rotary_mode):
        assert x.dim() == 4 and r1.dim() == 4 and r2.shape == r1.shape, "4-D tensors expected"
        assert x.dtype in FLOAT_DTYPES and r1.dtype == x.dtype and r2.dtype == x.dtype, "tables in x's dtype"
        assert rotary_mode in ("half", "interleave"), f"rotary_mode must be half or interleave, got {rotary_mode!r}"
        b, n, d = x.shape[0], x.shape[2], x.shape[3]  # BSND, as megacann passes it
        assert d % 2 == 0 and d < 896, f"head dim must be even and below 896, got {d}"
        assert (b < 1000 and n < 1000) if rotary_mode == "half" else b * n < 1000, f"b={b}, n={n} over the limits"
        rotated = _rotate_half(x) if rotary_mode == "half" else _rotate_pairs(x)
        return x * r1 + rotated * r2

    def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
        return _rotary(input, r1, r2, rotary_mode)

    def npu_rotary_mul_old(x, r1, r2):
        return _rotary(x, r1, r2, "half")

    def npu_swiglu(input, dim=-1):
        assert input.dtype in FLOAT_DTYPES and input.shape[dim] % 2 == 0, "swiglu: an even split dim"
        a, b = input.chunk(2, dim=dim)
        return F.silu(a) * b

    def npu_cross_entropy_loss(
        input, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
        lse_square_scale_for_zloss=0.0, return_zloss=False,
    ):  # fmt: skip
        assert input.dim() == 2 and target.dtype == torch.int64 and target.shape == input.shape[:1]
        assert input.dtype in FLOAT_DTYPES and input.shape[0] <= MAX_CE_ROWS, f"at most {MAX_CE_ROWS} rows"
        assert weight is None and label_smoothing == 0.0 and not return_zloss, "the fake models the plain loss"
        assert bool(((target >= 0) & (target < input.shape[1])).all()), "targets must lie in [0, C)"
        log_prob = torch.log_softmax(input.float(), dim=-1)
        loss = -log_prob.gather(1, target.unsqueeze(1)).squeeze(1)
        if ignore_index >= 0:  # documented: a negative ignore_index ignores nothing
            loss = loss.masked_fill(target == ignore_index, 0.0)
        assert reduction == "none", "the fake models reduction='none'"
        return loss.to(input.dtype), log_prob.to(input.dtype), torch.empty(0), torch.empty(0)

    def npu_apply_adam_w(
        beta1_power, beta2_power, lr, weight_decay, beta1, beta2, epsilon, grad, max_grad_norm, amsgrad, maximize,
        *, out,
    ):  # fmt: skip
        var, m, v = out
        assert not amsgrad and not maximize and max_grad_norm is None
        assert var.dtype in FLOAT_DTYPES and grad.shape == var.shape == m.shape == v.shape
        # the ApplyAdamW formula (the powers passed in are one step behind: the kernel multiplies once more)
        bias1, bias2 = 1 - beta1_power * beta1, 1 - beta2_power * beta2
        var.mul_(1 - lr * weight_decay)
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        var.addcdiv_(m, (v / bias2).sqrt_().add_(epsilon), value=-lr / bias1)
        return var, m, v

    rotary = npu_rotary_mul if release.rotary_mode else npu_rotary_mul_old
    rotary.__name__ = "npu_rotary_mul"
    return [npu_rms_norm, rotary, npu_swiglu, npu_cross_entropy_loss, npu_apply_adam_w]
