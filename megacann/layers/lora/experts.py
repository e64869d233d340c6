"""LoRA on the routed experts: every expert's ``gate_up_proj`` / ``down_proj`` gets its own (A, B).

Targets are the same names, with the same fused / part meaning, as on dense layers
(:func:`megacann.layers.lora.resolve_target`): ``gate_up_proj`` puts one rank-r LoRA on each expert's fused
matrix (one ``A``), ``gate_proj`` / ``up_proj`` an independent LoRA on that part's rows, ``down_proj`` one on
the output projection. The adapter lives in the projection's ``adapter`` slot
(``experts.<e>.gate_up_proj.adapter.lora_A``), named by the expert's global index, so it is drawn from its
name identically under every expert- and tensor-parallel layout. It is sharded like the weight it adapts:

- with expert tensor parallelism, ``gate_up_proj`` is column-like (``B`` split by rows, each part's block
  split, ``A`` whole with a partial gradient) and ``down_proj`` row-like (``A`` split by columns, ``B``
  whole with a partial gradient), as on a column- / row-parallel layer;
- without it every TP rank holds whole experts and routes its own tokens, so both matrices are whole and
  their gradients partial (summed over TP), like the expert weights'.

Adapter parameters are expert parameters (``expert=True``): their gradients reduce over the
expert-data-parallel group and ZeRO shards them there. :class:`GroupedExperts` adds
``scaling * B A dropout(x)`` for all its experts with two more grouped matmuls. Dropout masks are drawn
over the rank's expert input, so with ``lora_dropout > 0`` runs on different expert-parallel layouts are
equal in distribution, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from megacann import ops
from megacann.layers.lora.adapter import AdapterLayout, LoRAAdapter
from megacann.layers.sharding import get_sharding


def expert_lora_layout(projection: torch.nn.Module) -> AdapterLayout:
    """The LoRA layout of an expert projection (``ExpertProjection``): sharded like its weight."""
    sharding = get_sharding(projection.weight)
    out_size, in_size = sharding.full_shape
    return AdapterLayout(
        column=projection.column,
        in_size=in_size,
        out_size=out_size,
        blocks=(out_size // 2, out_size // 2) if projection.column else (out_size,),
        tp_rank=projection.tp_rank,
        tp_size=projection.tp_size,
        shard=sharding.tp_dim is not None,
        partial=sharding.tp_partial_grad,
        expert=True,
        dtype=projection.weight.dtype,
        device=projection.weight.device,
        what=f"LoRA on an expert's {'gate_up_proj' if projection.column else 'down_proj'} {[out_size, in_size]}",
    )


def add_grouped_lora(
    y: torch.Tensor, x: torch.Tensor, projections: Sequence[torch.nn.Module], tokens_per_expert: Sequence[int]
) -> torch.Tensor:
    """``y`` (the grouped base output of ``projections`` on ``x``) plus every expert's LoRA output, computed
    with two grouped matmuls; ``y`` unchanged when the experts carry no active adapter."""
    adapters: list[Optional[LoRAAdapter]] = [p.adapter for p in projections]
    active = [isinstance(a, LoRAAdapter) and not (a.merged or a.disabled) for a in adapters]
    if not any(active):
        return y
    if not all(active):
        raise RuntimeError("some experts of an MoE layer have an active LoRA and others not; attach to all of them")
    first = adapters[0]
    low_rank = ops.grouped_matmul(first.dropout_input(x), [a.lora_A for a in adapters], tokens_per_expert)
    delta = ops.grouped_matmul(low_rank * first.scaling, [a.local_b() for a in adapters], tokens_per_expert)
    return y + delta


def expert_layers_elsewhere(model: torch.nn.Module) -> list[str]:
    """Names of the expert projections of ``model``'s MoE layers that other expert-parallel ranks hold
    (``…experts.<e>.gate_up_proj`` / ``down_proj``): what an adapter file may name beside this rank's."""
    from megacann.layers.moe.experts import GroupedExperts

    names = []
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            held = set(module.expert_indices)
            names += [
                f"{name}.{e}.{proj}"
                for e in range(module.num_experts)
                if e not in held
                for proj in ("gate_up_proj", "down_proj")
            ]
    return names
