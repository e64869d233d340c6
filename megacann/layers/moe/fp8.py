"""FP8 products of the routed experts: each expert's rows multiply through ``ops.fp8_linear`` with scales of
their own (an expert's tokens, its weight, its output gradient), so no scale mixes two experts.

Which ranks share an expert's tensors, and so reduce its amax:

* expert parallelism: none. An expert lives on one rank of the expert-parallel group, and the dispatcher
  brings it every token routed to it there; the other ranks hold *other* experts, whose amax must never
  enter its scale.
* expert tensor parallelism (``tensor_parallel`` with tp > 1): the TP group. The tokens are gathered over
  it first, so every TP rank has the expert's whole input; ``gate_up`` is split like a column-parallel
  weight (output features), ``down`` like a row-parallel one (input features), and ``fp8_linear`` reduces
  the amax of each split tensor over that group.

Delayed scaling keeps one history per expert projection (``experts.<e>.gate_up_proj.fp8_expert_amax_history``,
``[1 + length, 3]``: the amax of the expert's input, its weight and its output gradient), named by the
expert's global index like its weights, so checkpoints move between expert-parallel sizes. After each
optimizer step a history's newest row is reduced over the expert-data-parallel ranks (those holding the same
experts, which saw other tokens), never the data-parallel group, whose other expert-parallel ranks hold
other experts (:func:`megacann.layers.fp8.roll_amax_histories`).

Refused by name: whole experts on every TP rank (each rank would scale its own share of an expert's tokens,
which no one-process scale matches) and context parallelism (an expert's tokens spread over the
context-parallel ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from megacann import ops
from megacann.layers.fp8 import check_fp8_layer, linear_product
from megacann.ops.fp8 import Fp8Settings
from megacann.ops.fp8_formats import Fp8Error


def check_fp8_experts(
    settings: Optional[Fp8Settings], what: str, ffn_hidden_size: int, tensor_parallel: bool, tp_size: int
) -> None:
    """Refuse, naming ``what``, the expert layouts whose FP8 scales could not equal one process's."""
    if settings is None:
        return
    if tp_size > 1 and not tensor_parallel:
        raise Fp8Error(
            f"{what}: precision.fp8 with whole experts on every tensor-parallel rank (moe expert_tensor_parallel "
            "false) is not supported: each rank would scale its own share of an expert's tokens"
        )
    if settings.token_group is not None:
        raise Fp8Error(f"{what}: precision.fp8 does not cover MoE experts under context parallelism yet")
    split = tp_size if tensor_parallel else 1
    check_fp8_layer(settings, f"{what} gate_up_proj", (ffn_hidden_size, ffn_hidden_size), 0, split)
    check_fp8_layer(settings, f"{what} down_proj", (ffn_hidden_size,), 1, split)


def fp8_grouped_linear(
    settings: Fp8Settings,
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    tokens_per_expert: Sequence[int],
    parallel: Optional[str],
    group: Optional[dist.ProcessGroup],
    histories: Optional[Sequence[Optional[torch.Tensor]]] = None,
) -> torch.Tensor:
    """``ops.grouped_matmul`` in FP8: expert ``i``'s ``tokens_per_expert[i]`` rows of ``x`` times
    ``weights[i].T`` by ``fp8_linear``, scaled per expert (by ``histories[i]`` under delayed scaling). An
    expert without tokens multiplies nothing (a plain product of no rows: its weight gets a zero gradient,
    its history no amax, and every rank of an expert-TP group, which shares the token counts, skips it alike)."""
    rows = torch.split(x, [int(n) for n in tokens_per_expert])
    histories = histories if histories is not None else [None] * len(weights)
    outputs = [
        linear_product(settings, part, w, None, parallel=parallel, group=group, amax_history=history)
        if part.shape[0]
        else ops.linear(part, w)
        for part, w, history in zip(rows, weights, histories)
    ]
    return torch.cat(outputs)


__all__ = ["check_fp8_experts", "fp8_grouped_linear"]
