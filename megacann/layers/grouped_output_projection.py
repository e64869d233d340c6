"""DeepSeek-V4's grouped low-rank output projection of attention: heads -> groups -> hidden.

The attention output ``[b, s, H·D]`` is very wide (V4-Flash: 64 heads of 512). Instead of one ``H·D -> h``
matrix, the heads are cut into ``num_groups`` consecutive groups; ``o_a_proj`` maps each group's
``H·D / g`` features to ``rank`` features with a matrix of its own (a block-diagonal linear; its weight
``[g·rank, H·D/g]`` stacks the groups' matrices, transformers' ``DeepseekV4GroupedLinear``), and
``o_b_proj`` mixes the ``g·rank`` results into the hidden size.

Tensor parallelism splits the heads, so each rank holds whole groups (``num_groups`` divisible by the TP
size): its rows of ``o_a_proj`` and its columns of the row-parallel ``o_b_proj``, whose output is summed
(or reduce-scattered over the sequence under sequence parallelism) as any attention output projection.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from megacann.layers import mappings
from megacann.layers.init import default_init_methods, make_parameter
from megacann.layers.linear import RowParallelLinear
from megacann.layers.sharding import InitMethod


class GroupedOutputProjection(torch.nn.Module):
    """``forward(x [b, s, H·D/tp]) -> [b, s, h]`` (``[b, s/tp, h]`` under sequence parallelism), ``x`` this
    rank's heads. Parameters: ``o_a_proj.weight`` ``[g·rank, H·D/g]`` (split by groups over TP) and
    ``o_b_proj.weight`` ``[h, g·rank]`` (row-parallel)."""

    def __init__(
        self,
        attention_width: int,
        hidden_size: int,
        num_groups: int,
        rank: int,
        sequence_parallel: Optional[bool] = None,
        init_method: Optional[InitMethod] = None,
        output_init_method: Optional[InitMethod] = None,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        tp_size, tp_rank = mappings.tp_world_size(group), mappings.tp_rank(group)
        if attention_width % num_groups or num_groups % tp_size:
            raise ValueError(
                f"GroupedOutputProjection: num_groups {num_groups} must divide the attention width "
                f"{attention_width} and be divisible by the tensor-parallel size {tp_size}"
            )
        self.num_groups, self.local_groups, self.rank = num_groups, num_groups // tp_size, rank
        self.group_width = attention_width // num_groups
        init, out_init = default_init_methods(init_method, output_init_method)
        self.o_a_proj = torch.nn.Module()  # transformers' name for the block-diagonal part
        self.o_a_proj.weight = make_parameter(
            (num_groups * rank, self.group_width),
            init,
            tp_rank=tp_rank,
            tp_size=tp_size,
            tp_dim=0,
            name=f"GroupedOutputProjection o_a_proj ({num_groups} groups)",
            dtype=dtype,
            device=device,
        )
        self.o_b_proj = RowParallelLinear(
            num_groups * rank,
            hidden_size,
            bias=False,
            sequence_parallel=sequence_parallel,
            init_method=out_init,
            group=group,
            dtype=dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expected = self.local_groups * self.group_width
        if x.shape[-1] != expected:
            raise ValueError(
                f"GroupedOutputProjection: input of width {x.shape[-1]}, expected {expected} (this rank's heads)"
            )
        groups = x.unflatten(-1, (self.local_groups, self.group_width))  # [..., g, H·D/g]
        weight = self.o_a_proj.weight.view(self.local_groups, self.rank, self.group_width)
        reduced = torch.einsum("...gi,gri->...gr", groups, weight)  # each group by its own matrix
        return self.o_b_proj(reduced.flatten(-2))

    def extra_repr(self) -> str:
        return f"num_groups={self.num_groups}, rank={self.rank}, group_width={self.group_width}"
