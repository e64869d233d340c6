"""FP8 products in the weight layers: the layer context's :class:`~megacann.ops.fp8.Fp8Settings` decide
whether a linear layer multiplies through ``ops.fp8_linear`` or ``ops.linear``, and the shapes a recipe
needs are checked when the layer is built, naming the layer.

A layer splits its weight over the tensor-parallel group (``column``: the output features, ``row``: the
input features). FP8 blocks must then be whole on every rank and line up with one process's blocks: each
fused block along the split dimension (``q | k | v``, ``gate | up``) must hold a whole number of the
recipe's blocks on every rank. Replicated key/value projections (fewer kv heads than ranks) quantise a
slice of a weight every rank holds whole, which no one-process scale matches: refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from megacann import ops
from megacann.ops.fp8 import Fp8Settings, quantize_operand, quantize_pair, selected_gemm, shared_token_amax
from megacann.ops.fp8_formats import Fp8Error, block_shape


def check_fp8_layer(
    settings: Optional[Fp8Settings], what: str, split_sizes: Sequence[int], split_dim: Optional[int], tp_size: int
) -> None:
    """Refuse, naming ``what``, a layer whose per-rank pieces along its split dimension (``split_sizes``:
    each fused block's full size; ``split_dim`` 0 for output features, 1 for input features) are no whole
    number of the recipe's blocks."""
    if settings is None or split_dim is None or tp_size == 1:
        return
    for role in ("weight", "activation", "gradient"):
        for b in block_shape(settings.recipe, role):
            if b is None or b == 1:
                continue
            for size in split_sizes:
                if (size // tp_size) % b:
                    raise Fp8Error(
                        f"{what}: precision.fp8={settings.recipe} needs every tensor-parallel piece of a split "
                        f"dimension to be a multiple of {b}, but a block of {size} features over {tp_size} ranks "
                        f"gives {size // tp_size} per rank"
                    )


def linear_product(
    settings: Optional[Fp8Settings],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    *,
    parallel: Optional[str],
    group: Optional[dist.ProcessGroup],
    amax_history: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` by ``ops.fp8_linear`` when ``settings`` ask for FP8, else ``ops.linear``."""
    if settings is None:
        return ops.linear(x, weight, bias)
    return ops.fp8_linear(
        x,
        weight,
        bias,
        recipe=settings.recipe,
        grad_format=settings.grad_format,
        parallel=parallel,
        group=group,
        amax_history=amax_history,
        token_group=settings.token_group,
    )


def _in_sequence_order(t: torch.Tensor, gathered_shape: torch.Size) -> torch.Tensor:
    """Rows of ``t`` rank-major (``[tp, b, s/tp]``, as gathered) as ``[b * s, features]`` in sequence order."""
    world, b, s_local, _ = gathered_shape
    return t.reshape(world, b, s_local, -1).movedim(0, 1).reshape(b * world * s_local, -1)


class Fp8GatheredProducts:
    """The FP8 products of a column-parallel projection whose sequence-parallel input is all-gathered chunk
    by chunk behind them (:mod:`megacann.layers.tp_overlap`), by the quantisation and the GEMM of
    ``ops.fp8_linear``'s selected implementation, so they equal the projection of the gathered input.

    Which group each operand's amax is reduced over: the weight's and the output gradient's as the plain
    column-parallel layer (the TP group where a block spans the split output features); the input, which
    each rank holds a sequence shard of until the gather, shares one amax over the TP group where its
    blocks span the tokens (tensorwise), agreed before the gather starts; per-token blocks (rowwise,
    blockwise, mxfp8) need none. Under context parallelism the tokens are split over the settings'
    ``token_group`` too, which every reduction over the tokens then also spans, as in ``fp8_linear``. The
    backward sees the whole gathered input, as the plain path does; the weight gradient's operands are put
    back in sequence order first, so tiles along the tokens are the plain path's tiles."""

    def __init__(self, settings: Fp8Settings, history: Optional[torch.Tensor]):
        self.settings, self.history = settings, history

    def _pair(self, a: torch.Tensor, b: torch.Tensor, product: str) -> tuple:
        s = self.settings
        formats = (s.grad_format, "e4m3")
        return quantize_pair(a, b, product, s.recipe, formats, "column", self.group, self.history, True, s.token_group)

    def start(self, x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.dtype:
        recipe, record = self.settings.recipe, torch.is_grad_enabled()  # as ops.fp8_linear's forward records
        self.group, self.gemm = group, selected_gemm(recipe, x.device.type)
        # the ranks holding the input's other tokens: the TP group's shards, and under CP the other chunks
        tokens = group if self.settings.token_group is None else (group, self.settings.token_group)
        self.amax = shared_token_amax(x.reshape(-1, x.shape[-1]), recipe, tokens, self.history, record)
        self.weight_q = quantize_operand(weight, "forward", 1, recipe, "e4m3", "column", group, self.history, record)
        return torch.float32

    def forward_rows(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        recipe = self.settings.recipe
        rows_q = quantize_operand(rows, "forward", 0, recipe, "e4m3", "column", self.group, amax=self.amax)
        out.copy_(self.gemm(rows_q, self.weight_q))

    def input_grad(self, grad_rm: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.gemm(*self._pair(grad_rm, weight.t(), "input_grad")).to(dtype)

    def prepare_weight_grad(self, grad_rm: torch.Tensor, gathered: torch.Tensor) -> None:
        # the operands' amax reductions before the reduce-scatter: on a GPU they would queue behind it
        self.weight_grad_operands = self._weight_grad_pair(grad_rm, gathered)

    def _weight_grad_pair(self, grad_rm: torch.Tensor, gathered: torch.Tensor) -> tuple:
        dy, x = (_in_sequence_order(t, gathered.shape) for t in (grad_rm, gathered))
        return self._pair(dy.t(), x.t(), "weight_grad")

    def weight_grad(self, grad_rm: torch.Tensor, gathered: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        prepared = getattr(self, "weight_grad_operands", None)
        self.weight_grad_operands = None
        operands = prepared if prepared is not None else self._weight_grad_pair(grad_rm, gathered)
        return self.gemm(*operands).to(weight.dtype)

    def bias_grad(self, grad_rm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return grad_rm.float().sum(0).to(dtype)


# the buffers a layer under delayed scaling keeps (saved in checkpoints): a dense layer's, and each routed
# expert projection's (rolled over the ranks holding the same experts, not the data-parallel group)
HISTORY = "fp8_amax_history"
EXPERT_HISTORY = "fp8_expert_amax_history"


def attach_history(layer: torch.nn.Module, settings: Optional[Fp8Settings], device=None, name: str = HISTORY) -> None:
    """Give ``layer`` its delayed-scaling buffer ``name`` when ``settings`` ask for one (persistent:
    checkpoints keep it, so a resumed run scales as the run that never stopped)."""
    history = settings.new_history(device) if settings is not None else None
    if history is not None:
        layer.register_buffer(name, history)


def roll_amax_histories(
    chunks: Sequence[torch.nn.Module],
    group: Optional[dist.ProcessGroup],
    expert_group: Optional[dist.ProcessGroup] = None,
) -> None:
    """End of an optimizer step under delayed scaling: each layer's amax of this step (row 0), reduced to the
    maximum over the ranks that saw other micro-batches of the same tensors (``group``: the data-parallel
    ranks for dense layers; ``expert_group``: the expert-data-parallel ranks for routed experts), becomes
    the newest history row; the oldest row drops out and row 0 starts again from zero. One collective for
    the dense layers, one for the experts."""
    for name, ranks in ((HISTORY, group), (EXPERT_HISTORY, expert_group)):
        histories = [b for chunk in chunks for n, b in chunk.named_buffers() if n.rpartition(".")[2] == name]
        if not histories:
            continue
        newest = torch.stack([h[0] for h in histories])
        if ranks is not None and dist.get_world_size(ranks) > 1:
            dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=ranks)
        for history, amax in zip(histories, newest):
            history[2:] = history[1:-1].clone()
            history[1] = amax
            history[0].zero_()


__all__ = [
    "Fp8Error",
    "Fp8GatheredProducts",
    "Fp8Settings",
    "attach_history",
    "check_fp8_layer",
    "linear_product",
    "roll_amax_histories",
]
