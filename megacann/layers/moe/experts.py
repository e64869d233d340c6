"""The routed experts held by one rank: SwiGLU MLPs named by their global index, computed together.

Expert parallelism gives each rank of the expert-parallel group ``num_experts / ep`` consecutive experts
(rank ``r`` holds ``r·E/ep … (r+1)·E/ep − 1``). Every expert is its own module, named by its *global*
index, so a parameter's name and value do not depend on the layout::

    experts.<e>.gate_up_proj.weight   [2·ffn, hidden]  cat(gate, up) by rows (each half split over TP)
    experts.<e>.down_proj.weight      [hidden, ffn]    (split over TP by columns)

Each projection has an ``adapter`` slot: a LoRA there (``experts.<e>.gate_up_proj.adapter.lora_A``…) is
computed beside the base with grouped matmuls too (:mod:`megacann.layers.lora.experts`).

Expert ``e``'s weights are drawn from a seed made of the layer's seed (one draw from torch's CPU RNG, the
same on every rank), ``e`` and the parameter's name, so whichever rank creates expert ``e`` creates the
same tensor. Checkpoints and Hugging Face exports keyed by parameter name therefore move between
expert-parallel sizes unchanged: a rank saves and loads the names it holds.

With expert tensor parallelism the matrices are split across the TP group like a column- then
row-parallel MLP, without the collectives: the caller gathers the TP group's tokens before and
reduce-scatters the (partial) outputs after. Without it every TP rank holds whole experts and their
gradients are partial per rank (``tp_partial_grad``), as each rank routes different tokens.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Optional, Union

import torch

from megacann import ops
from megacann.layers import mappings
from megacann.layers.context import current_layer_context
from megacann.layers.eager_regions import eager_under_compile
from megacann.layers.fp8 import Fp8Error
from megacann.layers.init import make_parameter
from megacann.layers.linear import add_adapter_output
from megacann.layers.lora.adapter import AdapterLayout
from megacann.layers.lora.experts import add_grouped_lora, expert_lora_layout
from megacann.layers.sharding import InitMethod


def expert_seed(layer_seed: int, expert_index: int, name: str) -> int:
    """The seed expert ``expert_index``'s parameter ``name`` is drawn from."""
    return (layer_seed * 1_000_003 + zlib.crc32(f"{expert_index}.{name}".encode())) % (2**63)


class ExpertProjection(torch.nn.Module):
    """Holds one expert matrix as ``weight`` (``F.linear`` layout), for Hugging-Face-like names, and an
    ``adapter`` slot for a LoRA (:mod:`megacann.layers.lora.experts`). ``column``: gate_up (output rows split
    over TP with expert tensor parallelism), else down (input columns split)."""

    def __init__(self, weight: torch.nn.Parameter, column: bool, tp_rank: int, tp_size: int):
        super().__init__()
        self.weight = weight
        self.column, self.tp_rank, self.tp_size = column, tp_rank, tp_size
        self.adapter: Optional[torch.nn.Module] = None

    def lora_layout(self) -> AdapterLayout:
        return expert_lora_layout(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x, self.weight)  # fp32 GEMMs where bf16 / fp16 GEMM is slow
        return add_adapter_output(self.adapter, y, x, None)


class ExpertMLP(torch.nn.Module):
    """One expert: ``down(silu(gate(x)) * up(x))``. With ``tensor_parallel`` and ``tp_size > 1`` this
    rank holds its slice (and computes a partial output); otherwise the whole expert, whose gradient is
    partial per TP rank when ``tp_size > 1``."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        expert_index: int,
        layer_seed: int,
        init_method: InitMethod,
        output_init_method: InitMethod,
        tp_rank: int = 0,
        tp_size: int = 1,
        tensor_parallel: bool = True,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        split = tensor_parallel  # a whole expert on every TP rank records no TP dimension
        where = dict(tp_rank=tp_rank if split else 0, tp_size=tp_size if split else 1)
        common = dict(
            **where,
            tp_partial_grad=not split and tp_size > 1,
            expert=True,
            dtype=dtype,
            device=device,
        )
        self.gate_up_proj = ExpertProjection(
            make_parameter(
                (2 * ffn_hidden_size, hidden_size),
                init_method,
                tp_dim=0 if split else None,
                tp_blocks=(ffn_hidden_size, ffn_hidden_size) if split else None,
                name=f"expert {expert_index} gate_up_proj (2 x ffn_hidden_size {ffn_hidden_size})",
                generator_seed=expert_seed(layer_seed, expert_index, "gate_up_proj.weight"),
                **common,
            ),
            column=True,
            **where,
        )
        self.down_proj = ExpertProjection(
            make_parameter(
                (hidden_size, ffn_hidden_size),
                output_init_method,
                tp_dim=1 if split else None,
                block_dim=1,  # drawn alike whether or not the experts are split
                name=f"expert {expert_index} down_proj (ffn_hidden_size {ffn_hidden_size})",
                generator_seed=expert_seed(layer_seed, expert_index, "down_proj.weight"),
                **common,
            ),
            column=False,
            **where,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.swiglu(self.gate_up_proj(x), overwrite_input=True))


class GroupedExperts(torch.nn.ModuleDict):
    """This rank's experts, keyed by global index. ``forward(x, tokens_per_expert)`` takes the tokens of
    its experts in expert order (``tokens_per_expert[i]`` rows for its ``i``-th expert) and computes all
    of them with two grouped matmuls (:func:`megacann.ops.grouped_matmul`)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        init_method: InitMethod,
        output_init_method: InitMethod,
        layer_seed: int,
        ep_rank: int = 0,
        ep_size: int = 1,
        tensor_parallel: bool = True,
        group: Optional[torch.distributed.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        if num_experts % ep_size:
            raise ValueError(f"num_experts {num_experts} is not divisible by expert_model_parallel_size {ep_size}")
        if current_layer_context().fp8 is not None:
            raise Fp8Error(
                f"GroupedExperts({num_experts} experts): precision.fp8 does not cover MoE experts yet "
                "(set precision.fp8=none, or exclude the MoE blocks with precision.fp8_exclude_first_layers / _last_layers)"
            )
        super().__init__()
        tp_size = mappings.tp_world_size(group)
        local = num_experts // ep_size
        self.num_experts = num_experts
        self.first_expert = ep_rank * local
        experts = {
            str(e): ExpertMLP(
                hidden_size,
                ffn_hidden_size,
                e,
                layer_seed,
                init_method,
                output_init_method,
                tp_rank=mappings.tp_rank(group),
                tp_size=tp_size,
                tensor_parallel=tensor_parallel,
                dtype=dtype,
                device=device,
            )
            for e in range(self.first_expert, self.first_expert + local)
        }
        self.update(experts)

    @property
    def expert_indices(self) -> range:
        """Global indices of the experts this rank holds."""
        return range(self.first_expert, self.first_expert + len(self))

    @eager_under_compile  # group sizes are host integers that change every step: eager under torch.compile
    def forward(self, x: torch.Tensor, tokens_per_expert: Sequence[int]) -> torch.Tensor:
        experts = list(self.values())
        projections = [e.gate_up_proj for e in experts]
        gate_up = ops.grouped_matmul(x, [p.weight for p in projections], tokens_per_expert)
        gate_up = add_grouped_lora(gate_up, x, projections, tokens_per_expert)
        hidden, projections = ops.swiglu(gate_up, overwrite_input=True), [e.down_proj for e in experts]
        out = ops.grouped_matmul(hidden, [p.weight for p in projections], tokens_per_expert)
        return add_grouped_lora(out, hidden, projections, tokens_per_expert)
