"""The layer context: how this process builds layers, said once instead of in every constructor.

A :class:`LayerContext` holds sequence parallelism (already off when the tensor-parallel group has one
rank), the parameters' dtype and device, the context-parallel attention algorithm, the initialisation
std (and the number of layers, for the scaled init of residual projections) and the recompute mode.
Every layer of :mod:`megacann.layers` takes these from the *current* context unless its own keyword
argument says otherwise. Set one for a block of code::

    with LayerContext(sequence_parallel=True, params_dtype=torch.bfloat16):
        model = MyModel(...)

A recipe's context is made above the layers, which know no recipe
(``megacann.models.layer_context_from_config(cfg, device)``, what every model family is built under).

Outside any ``with`` the current context is ``LayerContext()``: no sequence parallelism, torch's default
dtype, the accelerator's device, N(0, 0.02) weights, no recompute; what a one-process model wants. The
context-parallel algorithm has no default: attention that meets a context-parallel group of more than
one rank without an algorithm refuses to run, so a model that forgot it cannot silently get another.
Megatron-Core's ``TransformerConfig`` and torchtitan's ``ModelArgs`` play the same part there.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from megacann import parallel_state as ps
from megacann.layers.context_parallel import CONTEXT_PARALLEL_ALGORITHMS
from megacann.ops.fp8 import Fp8Settings

RECOMPUTE_MODES = ("none", "selective", "full")

_STACK: ContextVar[tuple[LayerContext, ...]] = ContextVar("megacann_layer_contexts", default=())


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"LayerContext.{name}={value!r} is not one of {allowed}{hint}")


@dataclass(frozen=True)
class LayerContext:
    """Settings every layer built under this context takes by default (see the module docstring).

    ``sequence_parallel``: activations between blocks are split along the sequence over the TP group;
    kept only when that group has more than one rank (one rank has nothing to split), so it reads False
    under tp 1. ``params_dtype`` / ``device``: where parameters are made (None: torch's default dtype,
    the accelerator's current device). ``context_parallel_algo``: ``ring``, ``allgather`` or ``ulysses``
    (None: not chosen; an error under context parallelism). ``init_method_std``: std of N(0, std²)
    weights; with ``num_layers`` the projections that feed the residual (``o_proj``, ``down_proj``) use
    Megatron's ``std / sqrt(2 · num_layers)``. ``recompute``: ``selective`` recomputes core attention in
    backward, ``full`` a whole block (for blocks that read it). ``tp_comm_overlap``: sequence-parallel
    column-parallel layers overlap their all-gather and reduce-scatter with their matmuls
    (:mod:`megacann.layers.tp_overlap`).

    ``with context:`` makes it the current context for the enclosed code (contexts nest)."""

    sequence_parallel: bool = False
    params_dtype: Optional[torch.dtype] = None
    device: Optional[Union[torch.device, str]] = None
    context_parallel_algo: Optional[str] = None
    init_method_std: float = 0.02
    num_layers: Optional[int] = None
    recompute: str = "none"
    tp_comm_overlap: bool = False
    fp8: Optional[Fp8Settings] = None  # linear layers multiply in FP8 (megacann.layers.fp8); None: not

    def __post_init__(self) -> None:
        if self.context_parallel_algo is not None:
            _check_choice("context_parallel_algo", self.context_parallel_algo, CONTEXT_PARALLEL_ALGORITHMS)
        _check_choice("recompute", self.recompute, RECOMPUTE_MODES)
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"LayerContext.num_layers must be >= 1, got {self.num_layers}")
        if self.sequence_parallel and ps.get_tensor_model_parallel_world_size() == 1:
            object.__setattr__(self, "sequence_parallel", False)

    @property
    def output_init_std(self) -> float:
        """Std of the projections that feed the residual: scaled by ``sqrt(2 · num_layers)`` when known."""
        if self.num_layers is None:
            return self.init_method_std
        return self.init_method_std / math.sqrt(2.0 * self.num_layers)

    def __enter__(self) -> LayerContext:
        _STACK.set(_STACK.get() + (self,))
        return self

    def __exit__(self, *exc: object) -> None:
        _STACK.set(_STACK.get()[:-1])


def current_layer_context() -> LayerContext:
    """The innermost context entered with ``with``, else the one-process defaults ``LayerContext()``."""
    stack = _STACK.get()
    return stack[-1] if stack else LayerContext()


def block_layer_context(layer_id: int) -> LayerContext:
    """The current context for building transformer block ``layer_id`` (global index): FP8 off where the
    settings exclude the block. Use as ``with block_layer_context(i): block = ...``."""
    ctx = current_layer_context()
    if ctx.fp8 is not None and not ctx.fp8.covers_layer(layer_id):
        return dataclasses.replace(ctx, fp8=None)
    return ctx


def resolve_sequence_parallel(value: Optional[bool]) -> bool:
    """A layer's ``sequence_parallel`` argument, or the current context's when it is None."""
    return current_layer_context().sequence_parallel if value is None else value


def resolve_init_stds(init_std: Optional[float], output_std: Optional[float]) -> tuple[float, float]:
    """A layer's (init std, std of its residual projections): the given ones, else the current context's.
    An output std left unset follows an explicit ``init_std``."""
    if init_std is not None:
        return init_std, init_std if output_std is None else output_std
    ctx = current_layer_context()
    return ctx.init_method_std, ctx.output_init_std if output_std is None else output_std


def with_context_defaults(config: Any, **more: Any) -> Any:
    """A layer config dataclass (``sequence_parallel``, ``init_method_std``, ``output_layer_init_std``,
    ``params_dtype`` fields) with the settings it leaves None taken from the current context; ``more``:
    further fields to replace."""
    init_std, output_std = resolve_init_stds(config.init_method_std, config.output_layer_init_std)
    return dataclasses.replace(
        config,
        sequence_parallel=resolve_sequence_parallel(config.sequence_parallel),
        init_method_std=init_std,
        output_layer_init_std=output_std,
        params_dtype=config.params_dtype or current_layer_context().params_dtype,
        **more,
    )
