"""Initialisation methods and the one helper every layer uses to create a sharded parameter.

A parameter is made by drawing this rank's part of it block by block (:mod:`megacann.layers.block_draw`)
from a seed taken from torch's CPU RNG, so a model under any TP size starts with exactly the weights of
the one-process model, provided the default RNG is seeded alike on every TP rank
(:func:`megacann.layers.random.model_parallel_manual_seed` does this). Each parameter carries its
:class:`~megacann.layers.sharding.ParamSharding` and its init method (attribute ``sharding.INIT_ATTR``), so a
model can later re-draw any parameter by name from its own seed, independently of the layout
(:func:`initialize_weights`). Under :func:`deferred_initialization` nothing is drawn while a model is
built: :func:`initialize_weights` then draws each parameter once, or nothing when the weights will be loaded.

Init methods are picklable ``functools.partial`` objects over the module-level functions below. A layer
given no init method, dtype or device takes them from the current
:class:`~megacann.layers.context.LayerContext`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import zlib
from collections.abc import Iterable, Iterator
from typing import Optional

import torch

from megacann import parallel_state as ps
from megacann.accelerator import get_accelerator
from megacann.layers.block_draw import BLOCK_DIM_ATTR
from megacann.layers.context import current_layer_context, resolve_init_stds
from megacann.layers.sharding import (
    INIT_ATTR,
    INIT_NAME_ATTR,
    InitMethod,
    ParamSharding,
    check_divisible,
    init_sharded_,
    set_sharding,
)

UNDRAWN_ATTR = "megacann_undrawn"  # allocated under deferred_initialization, not drawn yet
_DRAW_LATER, _LOADED = "later", "loaded"
_deferral: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("megacann_deferral", default=None)


@contextlib.contextmanager
def deferred_initialization(weights_loaded: bool = False) -> Iterator[None]:
    """Inside, :func:`make_parameter` allocates without drawing (the builder's :func:`initialize_weights`
    draws each parameter once, by name). ``weights_loaded``: :func:`initialize_weights` draws nothing
    either, for weights about to be loaded (``model.init_from``, a checkpoint): every parameter must then
    be loaded, its memory holds garbage until it is."""
    token = _deferral.set(_LOADED if weights_loaded else _DRAW_LATER)
    try:
        yield
    finally:
        _deferral.reset(token)


def _normal(tensor: torch.Tensor, std: float) -> torch.Tensor:
    return torch.nn.init.normal_(tensor, mean=0.0, std=std)


def _constant(tensor: torch.Tensor, value: float) -> torch.Tensor:
    return torch.nn.init.constant_(tensor, value)


def init_normal(std: float = 0.02) -> InitMethod:
    """N(0, std²) — Megatron's default for weights."""
    return functools.partial(_normal, std=std)


def init_scaled_normal(std: float, num_layers: int) -> InitMethod:
    """N(0, (std / sqrt(2·num_layers))²) — Megatron's init for the projections that feed a residual."""
    return functools.partial(_normal, std=std / math.sqrt(2.0 * num_layers))


def init_zeros() -> InitMethod:
    return functools.partial(_constant, value=0.0)


def init_ones() -> InitMethod:
    return functools.partial(_constant, value=1.0)


def default_init_methods(
    init_method: Optional[InitMethod] = None, output_init_method: Optional[InitMethod] = None
) -> tuple[InitMethod, InitMethod]:
    """A layer's (init, init of the projections that feed the residual): the given ones, else the current
    context's N(0, std²) and its scaled output init. An output init left unset follows an explicit
    ``init_method``."""
    if init_method is not None:
        return init_method, output_init_method or init_method
    std, output_std = resolve_init_stds(None, None)
    return init_normal(std), output_init_method or init_normal(output_std)


def resolve_device(device: Optional[torch.device | str]) -> torch.device:
    """``device`` if given, else the current layer context's, else the accelerator's current device."""
    if device is None:
        device = current_layer_context().device
    return torch.device(device) if device is not None else get_accelerator().current_device()


def make_parameter(
    full_shape: tuple[int, ...],
    init_method: InitMethod,
    *,
    tp_rank: int,
    tp_size: int,
    name: str,
    tp_dim: Optional[int] = None,
    tp_blocks: Optional[tuple[int, ...]] = None,
    tp_partial_grad: bool = False,
    logical_size: Optional[int] = None,
    expert: bool = False,
    generator_seed: Optional[int] = None,
    block_dim: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device | str] = None,
) -> torch.nn.Parameter:
    """Create this rank's shard of a parameter whose whole is ``full_shape``, initialised with its part of
    the whole tensor, tagged with its sharding and init method. ``name`` appears in the error raised when a
    size does not divide ``tp_size``. ``expert`` marks an expert-parallel parameter; ``generator_seed``
    seeds its draw instead of torch's CPU RNG (for parameters only some ranks create). ``block_dim``: the
    dim it is split along in the layouts that split it, for a parameter left whole in others (default:
    ``tp_dim``, else 0; see :mod:`megacann.layers.block_draw`). ``dtype`` / ``device`` None: the current
    layer context's (see :func:`resolve_device`). Under :func:`deferred_initialization` nothing is drawn."""
    sharding = ParamSharding(
        full_shape=tuple(full_shape),
        tp_dim=tp_dim,
        tp_blocks=tuple(tp_blocks) if tp_blocks is not None else None,
        tp_partial_grad=tp_partial_grad,
        logical_size=logical_size,
        expert=expert,
    )
    if tp_blocks is not None and tp_dim is not None and sum(tp_blocks) != full_shape[tp_dim]:
        raise ValueError(f"{name}: tp_blocks {tuple(tp_blocks)} do not add up to {full_shape[tp_dim]}")
    check_divisible(sharding, tp_size, name)
    dtype = dtype or current_layer_context().params_dtype or torch.get_default_dtype()
    local = torch.empty(sharding.local_shape(tp_size), dtype=dtype, device=resolve_device(device))
    param = torch.nn.Parameter(local)
    set_sharding(param, sharding)
    setattr(param, INIT_ATTR, init_method)
    if block_dim is not None:
        setattr(param, BLOCK_DIM_ATTR, block_dim)
    if _deferral.get() is None:
        init_sharded_(param, init_method, tp_rank, tp_size, generator_seed)
    else:
        setattr(param, UNDRAWN_ATTR, True)
        if (
            sharding.logical_size is not None and sharding.tp_dim is not None
        ):  # padding rows no loader writes: zeros, as a draw leaves them
            padding_rows_zero_(local, sharding, tp_rank, tp_size)
    return param


def padding_rows_zero_(local: torch.Tensor, sharding, tp_rank: int, tp_size: int) -> None:
    """Zero this rank's rows of a padded tensor (the vocabulary) that lie beyond its logical size."""
    dim = sharding.tp_dim
    rows = local.shape[dim]
    first = tp_rank * rows if tp_size > 1 else 0
    keep = max(0, min(rows, sharding.logical_size - first))
    local.narrow(dim, keep, rows - keep).zero_()


def parameter_seed(seed: int, name: str) -> int:
    """A seed per parameter name, so weights do not depend on which rank builds which layer."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def initialize_weights(model: torch.nn.Module, seed: int) -> None:
    """Draw this rank's part of every parameter from a seed derived from its name, block by block.

    Name parameters by their place in the whole model (global layer indices), and every TP / PP / virtual
    stage / expert-parallel layout starts from exactly the weights of one process. A parameter that copies
    another (a tied embedding's copy on the last stage) is drawn from the name in ``INIT_NAME_ATTR``.
    Under ``deferred_initialization(weights_loaded=True)`` nothing is drawn.
    """
    if _deferral.get() == _LOADED:
        return
    _draw_named(model.named_parameters(), seed)


def initialize_undrawn(models: Iterable[torch.nn.Module], seed: int) -> None:
    """Draw, as :func:`initialize_weights` does, the parameters built under :func:`deferred_initialization`
    that no one has drawn yet (a builder that relied on drawing at construction)."""
    _draw_named(((n, p) for m in models for n, p in m.named_parameters() if getattr(p, UNDRAWN_ATTR, False)), seed)


def _draw_named(named: Iterable[tuple[str, torch.nn.Parameter]], seed: int) -> None:
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for name, param in named:
        init = getattr(param, INIT_ATTR, None)
        if init is None:
            raise ValueError(f"parameter {name} has no init method (make it with megacann.layers.make_parameter)")
        key = getattr(param, INIT_NAME_ATTR, name)
        init_sharded_(param, init, tp_rank, tp_size, parameter_seed(seed, key))
        if hasattr(param, UNDRAWN_ATTR):
            delattr(param, UNDRAWN_ATTR)
