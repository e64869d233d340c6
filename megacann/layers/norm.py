"""RMSNorm and LayerNorm over the hidden dim, aware of sequence parallelism.

Norm weights are replicated on every TP rank. Under sequence parallelism each rank normalises only its
part of the sequence, so its weight gradient is partial: the parameters are marked ``tp_partial_grad``
and the gradient is summed over the TP group (:func:`megacann.layers.mappings.sync_partial_grads` or the
optimizer). ``sequence_parallel``, ``dtype`` and ``device`` left None come from the current
:class:`~megacann.layers.context.LayerContext`.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from megacann import ops
from megacann.layers.context import resolve_sequence_parallel
from megacann.layers.init import init_ones, init_zeros, make_parameter
from megacann.layers.sharding import mark_partial_grad


def _norm_parameter(hidden_size: int, ones: bool, sequence_parallel: bool, dtype, device) -> torch.nn.Parameter:
    param = make_parameter(
        (hidden_size,),
        init_ones() if ones else init_zeros(),
        tp_rank=0,
        tp_size=1,
        name="norm",
        dtype=dtype,
        device=device,
    )
    return mark_partial_grad(param) if sequence_parallel else param


class _HiddenNorm(torch.nn.Module):
    """What both norms hold: ``eps``, whether the sequence is split (``sequence_parallel``) and a weight of
    ones over the hidden dim."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel: Optional[bool], dtype, device):
        super().__init__()
        self.eps = eps
        self.sequence_parallel = sequence_parallel = resolve_sequence_parallel(sequence_parallel)
        self.weight = _norm_parameter(hidden_size, True, sequence_parallel, dtype, device)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class RMSNorm(_HiddenNorm):
    """``weight * x / sqrt(mean(x²) + eps)`` (LLaMA), through ``megacann.ops.rms_norm``."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        sequence_parallel: Optional[bool] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__(hidden_size, eps, sequence_parallel, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(_HiddenNorm):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` (GPT)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        sequence_parallel: Optional[bool] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__(hidden_size, eps, sequence_parallel, dtype, device)
        self.bias = _norm_parameter(hidden_size, False, self.sequence_parallel, dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
