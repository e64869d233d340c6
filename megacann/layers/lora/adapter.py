"""LoRA (low-rank adaptation) on column- and row-parallel linear layers, sharded like the layer it adapts.

A LoRA adds ``scaling * B A x`` to a frozen projection ``W x`` (``A`` ``[r, in]`` drawn at random, ``B``
``[out, r]`` zero, so the adapted model starts equal to the base; ``scaling = alpha / r``). Under tensor
parallelism the adapter follows its base layer, and tp N computes what one process computes:

- column-parallel (output rows split): ``B`` is split by rows with the weight (fused blocks each split,
  like the weight's ``tp_blocks``), ``A`` is replicated; each rank's ``A`` gradient covers only its rows,
  so it is marked ``tp_partial_grad`` (summed over TP by ``sync_partial_grads`` / the optimizer). The
  adapter reads the layer's prepared input, so sequence parallelism's gather (and its gradient's
  reduce-scatter) serve both;
- row-parallel (input columns split): ``A`` is split by columns with the weight, ``B`` is replicated and
  ``tp_partial_grad``; each rank's ``B A x_local`` is a partial sum added to the layer's partial output
  before its all-reduce (or reduce-scatter under sequence parallelism), so no extra collective runs;
- a column layer replicated over TP (kv heads fewer than TP ranks): ``A`` and ``B`` replicated, both
  ``tp_partial_grad``, and ``B`` sliced to the rows the layer serves.

Dropout on the adapter's input draws one mask over the whole input from the default generator (equal on
every TP rank) and keeps this rank's slice, so masks do not depend on the layout either.

Targets (which projections, fused or by part) are named as in :mod:`megacann.layers.lora.targets`.
Besides column- and row-parallel layers, any module with a ``lora_layout()`` method and an ``adapter``
slot takes a LoRA: MoE experts' projections do (:mod:`megacann.layers.lora.experts`).

Adapter parameters live in the layer's ``adapter`` slot (``…qkv_proj.adapter.lora_A`` / ``.lora_B``), are
made with :func:`make_parameter` (sharding and init method attached), so ``initialize_weights`` or
:func:`megacann.layers.lora.init_adapters_` draws them from their names, identically under every layout.
Putting adapters on a whole model, merging and removing them: :mod:`megacann.layers.lora.attach`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from megacann import ops
from megacann.layers import mappings
from megacann.layers.init import init_zeros, make_parameter
from megacann.layers.linear import ColumnParallelLinear, RowParallelLinear
from megacann.layers.lora.targets import LoRATarget
from megacann.ops.bf16_matmul import gemm_dtype

LORA_ATTR = "megacann_lora"  # marks adapter parameters

ParallelLinear = Union[ColumnParallelLinear, RowParallelLinear]


def _uniform(tensor: torch.Tensor, bound: float) -> torch.Tensor:
    return torch.nn.init.uniform_(tensor, -bound, bound)


def init_lora_a(in_size: int) -> Callable[[torch.Tensor], object]:
    """Kaiming-uniform with ``a = sqrt(5)`` for an ``A`` of ``in_size`` inputs (PEFT's and ``nn.Linear``'s
    default): U(-1/sqrt(in_size), 1/sqrt(in_size)), its bound fixed here since ``A`` is drawn in blocks."""
    return functools.partial(_uniform, bound=1.0 / math.sqrt(in_size))


def _mark(param: torch.nn.Parameter) -> torch.nn.Parameter:
    setattr(param, LORA_ATTR, True)
    return param


def is_lora_parameter(param: torch.Tensor) -> bool:
    return bool(getattr(param, LORA_ATTR, False))


def expand_b(
    b: torch.Tensor, target: LoRATarget, blocks: Sequence[int], chosen: Sequence[int], rank: int
) -> torch.Tensor:
    """``B`` (rows of the selected blocks, sizes ``chosen``) laid out over all output rows (``blocks``)
    ``[sum(blocks), groups * rank]``: zero rows for unselected blocks, each independent LoRA's rows in its
    own ``rank`` columns."""
    if all(target.selected) and target.groups == 1:
        return b
    pieces, rows, k = b.split(tuple(chosen), dim=0), [], 0
    width = target.groups * rank
    for size, selected in zip(blocks, target.selected):
        if not selected:
            rows.append(b.new_zeros(size, width))
            continue
        piece = pieces[k]
        if target.groups > 1:
            piece = F.pad(piece, (k * rank, width - (k + 1) * rank))
        rows.append(piece)
        k += 1
    return torch.cat(rows, dim=0)


@dataclass(frozen=True)
class AdapterLayout:
    """Where a LoRA sits and how it is sharded, read from the layer it adapts (:func:`adapter_layout`).

    ``column``: the layer's output rows may be split over TP (``B`` follows them), else its input columns
    (``A`` follows them). ``blocks``: the whole layer's output blocks (fused parts). ``tp_rank`` /
    ``tp_size``: recorded in the adapter's sharding. ``shard``: the adapter is split with its layer (False:
    whole on every rank). ``partial``: every rank's gradient of the whole-kept matrix (and of the other,
    when not sharded) is partial and summed over TP. ``expert``: reduced over the expert-data-parallel
    group, like the expert weight adapted."""

    column: bool
    in_size: int
    out_size: int
    blocks: tuple[int, ...]
    tp_rank: int
    tp_size: int
    shard: bool = True
    partial: bool = False
    expert: bool = False
    dtype: Optional[torch.dtype] = None
    device: Optional[torch.device] = None
    what: str = "LoRA"


def linear_layout(base: ParallelLinear) -> AdapterLayout:
    """The layout of a LoRA on a column- or row-parallel layer (see the module docstring)."""
    column = isinstance(base, ColumnParallelLinear)
    replicated = column and base.replicated
    return AdapterLayout(
        column=column,
        in_size=base.input_size,
        out_size=base.output_size,
        blocks=tuple(base.tp_blocks) if column and base.tp_blocks else (base.output_size,),
        tp_rank=mappings.tp_rank(base.group),
        tp_size=base.tp_size,
        shard=not replicated,
        partial=replicated,
        dtype=base.weight.dtype,
        device=base.weight.device,
        what=f"LoRA on {type(base).__name__}({base.input_size}, {base.output_size})",
    )


def adapter_layout(module: torch.nn.Module) -> Optional[AdapterLayout]:
    """The LoRA layout of a module that can carry an adapter in its ``adapter`` slot: a parallel linear
    layer, or any module with a ``lora_layout()`` method (e.g. an MoE expert's projection); else None."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return linear_layout(module)
    method = getattr(module, "lora_layout", None)
    return method() if callable(method) else None


class LoRAAdapter(torch.nn.Module):
    """The LoRA of one projection; installed in its ``adapter`` slot by :func:`attach_lora`.

    ``lora_A`` is ``[groups * r, in]`` (one ``[r, in]`` block per independent LoRA; split by columns on a
    row-parallel layer) and ``lora_B`` ``[rows of the selected blocks, r]`` (split by rows on a
    column-parallel layer). ``forward(x, rows)`` returns ``scaling * B A dropout(x)`` for this rank (None
    while merged into the base weight). ``base`` is the adapted layer or its :class:`AdapterLayout`.
    """

    def __init__(
        self,
        base: Union[torch.nn.Module, AdapterLayout],
        target: LoRATarget,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
    ):
        super().__init__()
        layout = base if isinstance(base, AdapterLayout) else adapter_layout(base)
        if layout is None:
            raise TypeError(f"LoRA attaches to ColumnParallelLinear / RowParallelLinear, not {type(base).__name__}")
        self.column = layout.column
        self.rank, self.alpha, self.scaling, self.dropout_p = rank, alpha, alpha / rank, dropout
        self.target = target
        self.tp_rank, self.tp_size, self.shard = layout.tp_rank, layout.tp_size, layout.shard
        self.merged = False
        self.disabled = False  # switched off for a while (adapters_disabled): the base layer alone
        blocks = layout.blocks
        if len(target.parts) == 1:  # one LoRA over the whole layer, whatever its blocks (B split like each)
            selected = (True,) * len(blocks)
        elif len(blocks) == len(target.parts):
            selected = target.selected
        else:
            raise ValueError(f"LoRA target {target.parts} does not match the layer's {len(blocks)} output blocks")
        chosen = tuple(b for b, s in zip(blocks, selected) if s)
        self.blocks, self.chosen = blocks, chosen  # whole-layer output blocks, and the adapted ones
        shards = self.tp_size if self.column and layout.shard else 1
        self.local_blocks = tuple(b // shards for b in blocks)
        self.local_chosen = tuple(b // shards for b in chosen)
        common = dict(
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            expert=layout.expert,
            dtype=layout.dtype,
            device=layout.device,
            name=layout.what,
        )
        if self.column:
            self.lora_A = make_parameter(  # partial where the rows of B (or the layer's heads) are split over TP
                (target.groups * rank, layout.in_size),
                init_lora_a(layout.in_size),
                tp_partial_grad=layout.shard or layout.partial,
                **common,
            )
            self.lora_B = make_parameter(
                (sum(chosen), rank),
                init_zeros(),
                tp_dim=0 if layout.shard else None,
                tp_blocks=chosen if len(chosen) > 1 and layout.shard else None,
                tp_partial_grad=layout.partial,
                **common,
            )
        else:
            self.lora_A = make_parameter(
                (rank, layout.in_size),
                init_lora_a(layout.in_size),
                tp_dim=1 if layout.shard else None,
                block_dim=1,  # drawn alike whether or not it is split
                tp_partial_grad=layout.partial,
                **common,
            )
            self.lora_B = make_parameter((layout.out_size, rank), init_zeros(), tp_partial_grad=True, **common)
        _mark(self.lora_A)
        _mark(self.lora_B)

    def extra_repr(self) -> str:
        parts = "+".join(self.target.selected_parts)
        sharing = "shared A" if self.target.shared else "A per part"
        return f"rank={self.rank}, alpha={self.alpha}, dropout={self.dropout_p}, parts={parts} ({sharing})"

    def local_b(self) -> torch.Tensor:
        """This rank's ``B`` laid out over the layer's local output rows ``[out_local, groups * r]``: zero rows
        for unselected blocks, and each independent LoRA's rows in its own ``r`` columns."""
        return expand_b(self.lora_B, self.target, self.local_blocks, self.local_chosen, self.rank)

    def full_delta(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``scaling * B A`` over the whole layer from whole ``A`` and ``B`` (e.g. read from a checkpoint):
        what merging adds to the layer's whole weight."""
        return _scaled_product(expand_b(b, self.target, self.blocks, self.chosen, self.rank), a, self.scaling)

    def dropout_input(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout_p == 0.0:
            return x
        keep = 1.0 - self.dropout_p
        split = not self.column and self.shard and self.tp_size > 1  # a row layer's input is this rank's slice
        shape = (*x.shape[:-1], x.shape[-1] * (self.tp_size if split else 1))
        mask = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(keep)
        if split:
            mask = mask.narrow(-1, self.tp_rank * x.shape[-1], x.shape[-1])
        return x * mask / keep

    def forward(self, x: torch.Tensor, rows: Optional[tuple[int, int]] = None) -> Optional[torch.Tensor]:
        if self.merged or self.disabled:
            return None
        b = self.local_b()
        if rows is not None:
            b = b[rows[0] : rows[1]]
        # ops.linear: fp32 GEMMs rounded once on CPUs without native bf16 / fp16 GEMM (megacann.ops.bf16_matmul)
        low_rank = ops.linear(self.dropout_input(x), self.lora_A)
        return ops.linear(low_rank * self.scaling, b)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scaling * B A`` for this rank's slice of the base weight."""
        return _scaled_product(self.local_b(), self.lora_A, self.scaling)


def _scaled_product(b: torch.Tensor, a: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * b @ a`` in the operands' dtype; as fp32 GEMM rounded once where bf16 / fp16 products take
    that route (:func:`megacann.ops.bf16_matmul.gemm_dtype`)."""
    mm = gemm_dtype(b, a)
    return ((b.to(mm) * scaling) @ a.to(mm)).to(b.dtype)
