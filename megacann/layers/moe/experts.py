"""The routed experts held by one rank: SwiGLU MLPs named by their global index, computed together.

Expert parallelism gives each rank of the expert-parallel group ``num_experts / ep`` consecutive experts
(rank ``r`` holds ``r·E/ep … (r+1)·E/ep − 1``). Every expert is its own module, named by its *global*
index, so a parameter's name and value do not depend on the layout::

    experts.<e>.gate_up_proj.weight   [2·ffn, hidden]  cat(gate, up) by rows (each half split over TP)
    experts.<e>.down_proj.weight      [hidden, ffn]    (split over TP by columns)
    experts.<e>.gate_up_proj.bias     [2·ffn]          with ``bias`` (gpt-oss): split as the weight's rows
    experts.<e>.down_proj.bias        [hidden]         whole; with expert TP each rank adds bias / tp

The activation is SwiGLU or gpt-oss's clamped SwiGLU (:mod:`megacann.layers.moe.activation`).

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
from megacann.layers.fp8 import EXPERT_HISTORY, attach_history
from megacann.layers.init import init_zeros, make_parameter
from megacann.layers.linear import add_adapter_output
from megacann.layers.lora.adapter import AdapterLayout
from megacann.layers.lora.experts import add_grouped_lora, expert_lora_layout
from megacann.layers.moe.activation import SWIGLU, ExpertActivation
from megacann.layers.moe.fp8 import check_fp8_experts, fp8_grouped_linear
from megacann.layers.sharding import InitMethod


def expert_seed(layer_seed: int, expert_index: int, name: str) -> int:
    """The seed expert ``expert_index``'s parameter ``name`` is drawn from."""
    return (layer_seed * 1_000_003 + zlib.crc32(f"{expert_index}.{name}".encode())) % (2**63)


class ExpertProjection(torch.nn.Module):
    """Holds one expert matrix as ``weight`` (``F.linear`` layout), for Hugging-Face-like names, and an
    ``adapter`` slot for a LoRA (:mod:`megacann.layers.lora.experts`). ``column``: gate_up (output rows split
    over TP with expert tensor parallelism), else down (input columns split). ``bias`` (optional) is added
    times ``bias_scale`` (1 / tp for a down projection split over TP, whose partial outputs are summed)."""

    def __init__(
        self,
        weight: torch.nn.Parameter,
        column: bool,
        tp_rank: int,
        tp_size: int,
        bias: Optional[torch.nn.Parameter] = None,
        bias_scale: float = 1.0,
    ):
        super().__init__()
        self.weight = weight
        self.bias, self.bias_scale = bias, bias_scale
        self.column, self.tp_rank, self.tp_size = column, tp_rank, tp_size
        self.adapter: Optional[torch.nn.Module] = None

    def lora_layout(self) -> AdapterLayout:
        return expert_lora_layout(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x, self.weight)  # fp32 GEMMs where bf16 / fp16 GEMM is slow
        if self.bias is not None:
            y = y + self.bias * self.bias_scale
        return add_adapter_output(self.adapter, y, x, None)


def add_expert_biases(y: torch.Tensor, projections: Sequence[ExpertProjection], tokens_per_expert: Sequence[int]):
    """``y`` (rows grouped by expert) plus each expert's bias on its rows; ``y`` when there are no biases."""
    if not projections or projections[0].bias is None:
        return y
    rows = [p.bias.expand(int(n), -1) * p.bias_scale for p, n in zip(projections, tokens_per_expert)]
    return y + torch.cat(rows)


class ExpertMLP(torch.nn.Module):
    """One expert: ``down(silu(gate(x)) * up(x))`` (``activation``: or the clamped SwiGLU), with biases on
    both projections when ``bias``. With ``tensor_parallel`` and ``tp_size > 1`` this rank holds its slice
    (and computes a partial output); otherwise the whole expert, whose gradient is partial per TP rank
    when ``tp_size > 1``."""

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
        bias: bool = False,
        activation: ExpertActivation = SWIGLU,
    ):
        super().__init__()
        self.activation = activation
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
            bias=self._bias((2 * ffn_hidden_size,), 0 if split else None, expert_index, "gate_up_proj", common)
            if bias
            else None,
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
            bias=self._bias((hidden_size,), None, expert_index, "down_proj", common, partial=split and tp_size > 1)
            if bias
            else None,
            bias_scale=1.0 / tp_size if split else 1.0,  # the TP ranks' partial outputs are summed
            **where,
        )

    @staticmethod
    def _bias(shape, tp_dim, expert_index: int, name: str, common: dict, partial: bool = False):
        """A zero-initialised expert bias, split over TP along ``tp_dim`` (None: whole)."""
        options = dict(common, tp_partial_grad=common["tp_partial_grad"] or partial)
        if tp_dim is None:
            options.update(tp_rank=0, tp_size=1)
        blocks = (shape[0] // 2, shape[0] // 2) if tp_dim is not None else None
        return make_parameter(
            shape, init_zeros(), tp_dim=tp_dim, tp_blocks=blocks, name=f"expert {expert_index} {name} bias", **options
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_up_proj(x)))


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
        bias: bool = False,
        activation: ExpertActivation = SWIGLU,
    ):
        if num_experts % ep_size:
            raise ValueError(f"num_experts {num_experts} is not divisible by expert_model_parallel_size {ep_size}")
        tp_size = mappings.tp_world_size(group)
        fp8 = current_layer_context().fp8  # precision.fp8: per-expert FP8 products (megacann.layers.moe.fp8)
        check_fp8_experts(fp8, f"GroupedExperts({num_experts} experts)", ffn_hidden_size, tensor_parallel, tp_size)
        super().__init__()
        self.fp8 = fp8
        split = tensor_parallel and tp_size > 1  # each expert's weights split over the TP group
        self.fp8_group = mappings.tp_group(group) if split else None  # the ranks sharing each expert's tensors
        self.fp8_parallel = ("column", "row") if split else (None, None)
        local = num_experts // ep_size
        self.num_experts = num_experts
        self.first_expert = ep_rank * local
        self.activation = activation
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
                bias=bias,
                activation=activation,
            )
            for e in range(self.first_expert, self.first_expert + local)
        }
        self.update(experts)
        for expert in experts.values():  # delayed scaling: a history per expert projection (megacann.layers.moe.fp8)
            for projection in (expert.gate_up_proj, expert.down_proj):
                attach_history(projection, fp8, projection.weight.device, EXPERT_HISTORY)

    @property
    def expert_indices(self) -> range:
        """Global indices of the experts this rank holds."""
        return range(self.first_expert, self.first_expert + len(self))

    def _grouped_product(self, x, projections, tokens_per_expert, parallel: Optional[str]) -> torch.Tensor:
        weights = [p.weight for p in projections]
        if self.fp8 is None:
            return ops.grouped_matmul(x, weights, tokens_per_expert)
        histories = [getattr(p, EXPERT_HISTORY, None) for p in projections]
        return fp8_grouped_linear(self.fp8, x, weights, tokens_per_expert, parallel, self.fp8_group, histories)

    @eager_under_compile  # group sizes are host integers that change every step: eager under torch.compile
    def forward(self, x: torch.Tensor, tokens_per_expert: Sequence[int]) -> torch.Tensor:
        experts = list(self.values())
        projections = [e.gate_up_proj for e in experts]
        gate_up = self._grouped_product(x, projections, tokens_per_expert, self.fp8_parallel[0])
        gate_up = add_grouped_lora(gate_up, x, projections, tokens_per_expert)
        gate_up = add_expert_biases(gate_up, projections, tokens_per_expert)
        hidden, projections = self.activation(gate_up), [e.down_proj for e in experts]
        out = self._grouped_product(hidden, projections, tokens_per_expert, self.fp8_parallel[1])
        out = add_grouped_lora(out, hidden, projections, tokens_per_expert)
        return add_expert_biases(out, projections, tokens_per_expert)
