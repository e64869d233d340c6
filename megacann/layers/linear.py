"""Column- and row-parallel linear layers (Megatron's split of ``y = x Aᵀ + b``).

A :class:`ColumnParallelLinear` splits the output features: each TP rank holds ``[output_size/tp,
input_size]`` rows of the weight and produces its slice of the output. A :class:`RowParallelLinear` splits
the input features: each rank holds ``[output_size, input_size/tp]``, multiplies its slice of the input,
and the partial results are summed over the TP group. A column layer followed by a row layer (attention,
MLP) needs one all-reduce forward and one backward.

Under sequence parallelism the activations between blocks are split along the sequence (dim 1 of
``[batch, seq, hidden]``): the column layer all-gathers the sequence first, and the row layer
reduce-scatters its output back to sequence shards instead of all-reducing.

Both layers have an ``adapter`` slot (None by default): a module called as ``adapter(x_local, rows)`` on
the same local input as the weight, whose output (or None) is added to the local output before any gather
or reduction, so it is sharded and reduced like the base layer (LoRA: :mod:`megacann.layers.lora`).

Arguments left None (``sequence_parallel``, ``init_method``, ``dtype``, ``device``) come from the current
:class:`~megacann.layers.context.LayerContext`.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from megacann import ops
from megacann.layers import mappings
from megacann.layers.context import current_layer_context, resolve_sequence_parallel
from megacann.layers.fp8 import Fp8Error, Fp8GatheredProducts, attach_history, check_fp8_layer, linear_product
from megacann.layers.init import default_init_methods, init_zeros, make_parameter
from megacann.layers.sharding import InitMethod, ParamSharding, unshard_tensors
from megacann.layers.tp_overlap import overlapped_gather_linear

LinearOutput = Union[torch.Tensor, tuple[torch.Tensor, Optional[torch.Tensor]]]


def add_adapter_output(
    adapter: Optional[torch.nn.Module], y: torch.Tensor, x: torch.Tensor, rows: Optional[tuple[int, int]]
) -> torch.Tensor:
    """``y`` plus the adapter's output on the same local input (an adapter may return None: inactive)."""
    if adapter is None:
        return y
    delta = adapter(x, rows)
    return y if delta is None else y + delta


class ColumnParallelLinear(torch.nn.Module):
    """``y = x Wᵀ + b`` with ``W`` ``[output_size, input_size]`` split by rows (output features).

    Args:
        gather_output: all-gather the output features, so every rank returns the whole ``y``; otherwise
            each rank returns its ``output_size/tp`` slice (the usual case, fed to a row-parallel layer).
        sequence_parallel: the input is split along the sequence; all-gather it first.
        tp_blocks: sizes of fused blocks along the output (e.g. ``(q, k, v)`` or ``(ffn, ffn)`` for a fused
            gate/up projection); each block is split across TP separately, so every rank holds a slice of
            each block, in block order.
        skip_bias_add: return ``(y, bias)`` with the bias not added (for fusing it into a later op).
        replicated: keep the whole weight on every TP rank (its gradient partial per rank, to be summed
            over TP); used for key/value projections when there are fewer kv heads than TP ranks.
        group: the tensor-parallel group (default: from :mod:`megacann.parallel_state`).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: Optional[bool] = None,
        init_method: Optional[InitMethod] = None,
        skip_bias_add: bool = False,
        tp_blocks: Optional[tuple[int, ...]] = None,
        replicated: bool = False,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        self.group = group
        self.tp_size = mappings.tp_world_size(group)
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel = resolve_sequence_parallel(sequence_parallel)
        self.skip_bias_add = skip_bias_add
        self.replicated = replicated
        self.tp_blocks = tuple(tp_blocks) if tp_blocks is not None else None
        if replicated and gather_output:
            raise ValueError(
                "ColumnParallelLinear: replicated=True already returns the whole output; drop gather_output"
            )
        tp_size = 1 if replicated else self.tp_size
        common = dict(
            tp_rank=mappings.tp_rank(group),
            tp_size=tp_size,
            tp_dim=None if replicated else 0,
            tp_blocks=None if replicated else self.tp_blocks,
            tp_partial_grad=replicated,
            dtype=dtype,
            device=device,
        )
        self.weight = make_parameter(
            (output_size, input_size),
            init_method or default_init_methods()[0],
            name=f"ColumnParallelLinear output_size {output_size}",
            **common,
        )
        self.bias = None
        if bias:
            self.bias = make_parameter(
                (output_size,), init_zeros(), name=f"ColumnParallelLinear output_size {output_size}", **common
            )
        self.adapter: Optional[torch.nn.Module] = None
        # distributed.tp_comm_overlap (the layer context's): the sequence all-gather overlaps this layer's
        # matmul and the input gradient's reduce-scatter its weight gradient (megacann.layers.tp_overlap)
        self.comm_overlap = current_layer_context().tp_comm_overlap and sequence_parallel and not replicated
        self.fp8 = current_layer_context().fp8  # precision.fp8: the product by ops.fp8_linear (megacann.layers.fp8)
        what = f"ColumnParallelLinear({input_size} -> {output_size})"
        if self.fp8 is not None and replicated:
            raise Fp8Error(f"{what}: precision.fp8 does not support a replicated kv projection yet")
        check_fp8_layer(self.fp8, what, self.tp_blocks or (output_size,), 0, tp_size)
        attach_history(self, self.fp8, self.weight.device)

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """Bring ``x`` into the tensor-parallel region: all-gather the sequence (sequence parallel) or
        mark it for a gradient all-reduce. Several column layers reading the same input (q, k, v) share
        one prepared input, hence one collective each way."""
        if self.sequence_parallel:
            return mappings.gather_from_sequence_parallel_region(x, self.group)
        return mappings.copy_to_tensor_model_parallel_region(x, self.group, inplace=True)

    def forward_prepared(self, x: torch.Tensor, rows: Optional[tuple[int, int]] = None) -> LinearOutput:
        """The projection of an input already passed through :meth:`prepare_input`. ``rows=(start, end)``
        uses only those output rows of the local weight (a replicated kv projection serving some heads)."""
        weight, bias = self.weight, self.bias
        if rows is not None:
            weight = weight[rows[0] : rows[1]]
            bias = bias[rows[0] : rows[1]] if bias is not None else None
        if self.fp8 is None:  # the plain product (the group and amax history only matter to FP8)
            y = ops.linear(x, weight, None if self.skip_bias_add else bias)
        else:
            y = linear_product(
                self.fp8,
                x,
                weight,
                None if self.skip_bias_add else bias,
                parallel="column" if self.tp_size > 1 and not self.replicated else None,
                group=mappings.tp_group(self.group),
                amax_history=getattr(self, "fp8_amax_history", None),
            )
        y = add_adapter_output(self.adapter, y, x, rows)
        if self.gather_output and self.tp_size > 1:
            y = mappings.gather_from_tensor_model_parallel_region(y, self.group)
            if self.tp_blocks is not None and len(self.tp_blocks) > 1:
                y = self._blocks_in_order(y)
        return (y, bias) if self.skip_bias_add else y

    def forward(self, x: torch.Tensor) -> LinearOutput:
        """``x`` ``[..., input_size]`` (``[b, s/tp, input_size]`` under sequence parallelism) →
        ``[..., output_size/tp]`` (or ``[..., output_size]`` with ``gather_output``)."""
        if self.comm_overlap and self.tp_size > 1 and self.adapter is None and not self.gather_output and x.dim() == 3:
            bias = None if self.skip_bias_add else self.bias
            history = getattr(self, "fp8_amax_history", None)
            products = Fp8GatheredProducts(self.fp8, history) if self.fp8 is not None else None
            y = overlapped_gather_linear(x, self.weight, bias, mappings.tp_group(self.group), products)
            return (y, self.bias) if self.skip_bias_add else y
        return self.forward_prepared(self.prepare_input(x))

    def _blocks_in_order(self, y: torch.Tensor) -> torch.Tensor:
        """Gathered output is rank-major (rank 0's slices of every block, then rank 1's …); restore the
        order of the blocks."""
        layout = ParamSharding(full_shape=tuple(y.shape), tp_dim=y.dim() - 1, tp_blocks=self.tp_blocks)
        return unshard_tensors(list(y.chunk(self.tp_size, dim=-1)), layout)


class RowParallelLinear(torch.nn.Module):
    """``y = x Wᵀ + b`` with ``W`` ``[output_size, input_size]`` split by columns (input features).

    Args:
        input_is_parallel: the input is already split along its last dim (the output of a column layer);
            otherwise this layer keeps its own slice of it.
        sequence_parallel: reduce-scatter the output along the sequence instead of all-reducing it.
        skip_bias_add: return ``(y, bias)`` with the bias not added.

    The bias is replicated and added after the reduction (under sequence parallelism each rank adds it to
    its sequence shard, so its gradient is partial and marked ``tp_partial_grad``).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: Optional[bool] = None,
        init_method: Optional[InitMethod] = None,
        skip_bias_add: bool = False,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        from_context = sequence_parallel is None
        self.sequence_parallel = sequence_parallel = resolve_sequence_parallel(sequence_parallel)
        if sequence_parallel and not input_is_parallel:
            where = " (from the layer context; pass sequence_parallel=False)" if from_context else ""
            raise ValueError(f"RowParallelLinear: sequence_parallel=True{where} requires input_is_parallel=True")
        self.group = group
        self.tp_size = mappings.tp_world_size(group)
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        tp_rank = mappings.tp_rank(group)
        self.weight = make_parameter(
            (output_size, input_size),
            init_method or default_init_methods()[0],
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            tp_dim=1,
            name=f"RowParallelLinear input_size {input_size}",
            dtype=dtype,
            device=device,
        )
        self.bias = None
        if bias:
            self.bias = make_parameter(
                (output_size,),
                init_zeros(),
                tp_rank=tp_rank,
                tp_size=self.tp_size,
                tp_partial_grad=sequence_parallel,
                name="RowParallelLinear bias",
                dtype=dtype,
                device=device,
            )
        self.adapter: Optional[torch.nn.Module] = None
        self.fp8 = current_layer_context().fp8  # precision.fp8 (megacann.layers.fp8)
        check_fp8_layer(self.fp8, f"RowParallelLinear({input_size} -> {output_size})", (input_size,), 1, self.tp_size)
        attach_history(self, self.fp8, self.weight.device)

    def _product(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.fp8 is None:
            return ops.linear(x, self.weight, bias)
        return linear_product(
            self.fp8,
            x,
            self.weight,
            bias,
            parallel="row" if self.tp_size > 1 else None,
            group=mappings.tp_group(self.group),
            amax_history=getattr(self, "fp8_amax_history", None),
        )

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )

    def forward(self, x: torch.Tensor) -> LinearOutput:
        """``x`` ``[..., input_size/tp]`` (or ``[..., input_size]`` without ``input_is_parallel``) →
        ``[..., output_size]`` (``[b, s/tp, output_size]`` under sequence parallelism)."""
        add_bias = self.bias is not None and not self.skip_bias_add
        if self.tp_size == 1:
            y = self._product(x, self.bias if add_bias else None)
            y = add_adapter_output(self.adapter, y, x, None)
        else:
            if not self.input_is_parallel:
                x = mappings.scatter_to_tensor_model_parallel_region(x, self.group)
            y = self._product(x, None)
            y = add_adapter_output(self.adapter, y, x, None)  # partial sums, reduced with the base layer's
            if self.sequence_parallel:
                y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.group)
            else:
                y = mappings.reduce_from_tensor_model_parallel_region(y, self.group, inplace=True)
            if add_bias:
                y = y + self.bias
        return (y, self.bias) if self.skip_bias_add else y
