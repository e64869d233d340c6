"""Feed-forward blocks: a column-parallel up projection, an activation, a row-parallel down projection.

Names follow Hugging Face LLaMA: ``gate_proj``, ``up_proj``, ``down_proj``; the fused form ``gate_up_proj``
holds ``cat(gate_proj, up_proj)`` along the output rows (each half split across TP separately).
Arguments left None (``sequence_parallel``, the init methods, ``dtype``, ``device``) come from the current
:class:`~megacann.layers.context.LayerContext`; ``down_proj`` feeds the residual and gets its output init.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megacann import ops
from megacann.layers.init import default_init_methods
from megacann.layers.linear import ColumnParallelLinear, RowParallelLinear
from megacann.layers.sharding import InitMethod

GELU_APPROXIMATIONS = ("none", "tanh")


class SwiGLUMLP(torch.nn.Module):
    """``down(silu(gate(x)) * up(x))`` (LLaMA). ``fused_gate_up`` computes gate and up in one matmul.
    ``activation`` (fused form only): another gated activation of the ``gate|up`` tensor, e.g. the clamped
    SwiGLU of an MoE layer's shared experts (:class:`~megacann.layers.moe.activation.ExpertActivation`)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = False,
        sequence_parallel: Optional[bool] = None,
        fused_gate_up: bool = True,
        init_method: Optional[InitMethod] = None,
        output_init_method: Optional[InitMethod] = None,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
        activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ):
        super().__init__()
        if activation is not None and not fused_gate_up:
            raise ValueError("SwiGLUMLP: an activation other than SwiGLU needs fused_gate_up=True")
        linear = dict(bias=bias, sequence_parallel=sequence_parallel, group=group, dtype=dtype, device=device)
        init_method, output_init_method = default_init_methods(init_method, output_init_method)
        self.fused_gate_up, self.activation = fused_gate_up, activation
        if fused_gate_up:
            self.gate_up_proj = ColumnParallelLinear(
                hidden_size,
                2 * ffn_hidden_size,
                init_method=init_method,
                tp_blocks=(ffn_hidden_size, ffn_hidden_size),
                **linear,
            )
        else:
            self.gate_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, init_method=init_method, **linear)
            self.up_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, init_method=init_method, **linear)
        self.down_proj = RowParallelLinear(ffn_hidden_size, hidden_size, init_method=output_init_method, **linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation is not None:
            return self.down_proj(self.activation(self.gate_up_proj(x)))
        if self.fused_gate_up:
            # the gate|up projection is read by nothing else: its backward may reuse its memory
            return self.down_proj(ops.swiglu(self.gate_up_proj(x), overwrite_input=True))
        x = self.gate_proj.prepare_input(x)
        return self.down_proj(ops.swiglu(self.gate_proj.forward_prepared(x), self.up_proj.forward_prepared(x)))


class GeluMLP(torch.nn.Module):
    """``down(gelu(up(x)))`` (GPT); ``approximate="tanh"`` is GPT-2's ``gelu_new``."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        sequence_parallel: Optional[bool] = None,
        approximate: str = "none",
        init_method: Optional[InitMethod] = None,
        output_init_method: Optional[InitMethod] = None,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        if approximate not in GELU_APPROXIMATIONS:
            raise ValueError(f"GeluMLP approximate={approximate!r}; expected one of {GELU_APPROXIMATIONS}")
        self.approximate = approximate
        linear = dict(bias=bias, sequence_parallel=sequence_parallel, group=group, dtype=dtype, device=device)
        init_method, output_init_method = default_init_methods(init_method, output_init_method)
        self.up_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, init_method=init_method, **linear)
        self.down_proj = RowParallelLinear(ffn_hidden_size, hidden_size, init_method=output_init_method, **linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate))
