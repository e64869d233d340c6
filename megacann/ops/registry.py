"""A small registry of fused operators: several implementations per op, chosen per device type.

An op is declared once (:func:`declare`: name, signature, docstring; the declarations are
:mod:`megacann.ops.signatures`), which makes its public function; implementations register under the
declared name and are checked against the declared signature as they register (:mod:`megacann.ops.opspec`).
Every op has a PyTorch ``reference`` implementation that runs anywhere. Faster ones (torch_npu kernels,
the C++ extension in ``csrc/``, CUDA kernels) register under the same op name with a priority, the device
types they serve and an availability check; the check runs once, lazily, on first use, so registering
never imports an optional package. :func:`resolve` returns the highest-priority available implementation
for a device type and caches the answer; :func:`pin` forces one (tests, benchmarks).

:func:`configure` applies a recipe's ``precision.fused_ops`` (which ops may use a fused implementation)
and ``precision.fp32_ops`` (which ops compute in fp32: floating inputs in bf16/fp16 are upcast, results
cast back). :func:`selection` names what each op resolves to on a device, :func:`selection_line` says it
in one line for the start of a run.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from megacann.ops.opspec import OpSpec, make_function, mismatches

REFERENCE = "reference"
LOW_PRECISION = (torch.bfloat16, torch.float16)
logger = logging.getLogger("megacann.ops")
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


@dataclass(frozen=True)
class OpImpl:
    op: str
    name: str
    fn: Callable
    priority: int
    device_types: Optional[frozenset[str]]  # None: any device
    available: Callable[[], bool]

    def serves(self, device_type: str) -> bool:
        return self.device_types is None or device_type in self.device_types


_SPECS: dict[str, OpSpec] = {}
_IMPLS: dict[str, dict[str, OpImpl]] = {}
_PINNED: dict[str, str] = {}
_PIN_ALL: Optional[str] = None
_FUSED: Optional[frozenset[str]] = None  # None: every op may use a fused implementation
_FP32: frozenset[str] = frozenset()
_CACHE: dict[tuple[str, str], tuple[OpImpl, Callable]] = {}
_AVAILABLE: dict[tuple[str, str], bool] = {}


def register(
    op: str,
    name: str,
    *,
    priority: int = 0,
    device_types: Optional[tuple[str, ...]] = None,
    available: Optional[Callable[[], bool]] = None,
) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as implementation ``name`` of the declared ``op``. Higher priority wins;
    the reference implementation has priority 0. TypeError when ``fn`` does not fit the declared signature
    (:func:`megacann.ops.opspec.mismatches`), KeyError when ``op`` is not declared."""

    def decorate(fn: Callable) -> Callable:
        problems = mismatches(_spec(op), fn)
        if problems:
            raise TypeError(
                f"implementation {name!r} of op {op!r} does not fit the declared signature "
                f"{op}{_SPECS[op].signature}: " + "; ".join(problems)
            )
        impl = OpImpl(op, name, fn, priority, frozenset(device_types) if device_types else None, available or _always)
        _IMPLS.setdefault(op, {})[name] = impl
        _CACHE.clear()
        return fn

    return decorate


def declare(
    stub: Optional[Callable] = None, *, prepare: Optional[Callable[..., tuple]] = None, fp32_result: bool = False
) -> Any:
    """Decorator: declare the op named, typed and documented by ``stub`` (its body is never run) and return
    its public function, which dispatches by the device type of its first argument. ``prepare`` checks and
    normalises the arguments first; ``fp32_result`` marks an op whose result is fp32 by contract (a loss),
    which ``precision.fp32_ops`` never casts back. See :class:`megacann.ops.opspec.OpSpec`."""

    def decorate(fn: Callable) -> Callable:
        spec = OpSpec.from_stub(fn, prepare=prepare, fp32_result=fp32_result)
        if spec.name in _SPECS:
            raise ValueError(f"op {spec.name!r} is declared twice")
        _SPECS[spec.name] = spec
        _IMPLS.setdefault(spec.name, {})
        _CACHE.clear()
        return make_function(spec, resolve, fn.__module__)

    return decorate if stub is None else decorate(stub)


def _spec(op: str) -> OpSpec:
    if op not in _SPECS:
        raise KeyError(f"unknown op {op!r}; declared ops: {ops()}")
    return _SPECS[op]


def _always() -> bool:
    return True


def _is_available(impl: OpImpl) -> bool:
    key = (impl.op, impl.name)
    if key not in _AVAILABLE:
        try:
            _AVAILABLE[key] = bool(impl.available())
        except Exception:  # an availability check must never break the caller
            _AVAILABLE[key] = False
    return _AVAILABLE[key]


def ops() -> list[str]:
    """The declared ops, sorted."""
    return sorted(_SPECS)


def implementations(op: str) -> list[str]:
    """Names of the implementations registered for ``op``, best first."""
    return [i.name for i in sorted(_impls(op).values(), key=lambda i: -i.priority)]


def _impls(op: str) -> dict[str, OpImpl]:
    _spec(op)
    return _IMPLS.setdefault(op, {})


def resolve(op: str, device_type: str) -> Callable:
    """The implementation of ``op`` to use on ``device_type`` (cached), wrapped to compute in fp32 when
    ``op`` is one of the fp32 ops."""
    key = (op, device_type)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit[1]
    if _is_compiling():  # availability checks import packages / build kernels: not traceable
        raise RuntimeError(
            f"megacann.ops: {op!r} on {device_type} is resolved for the first time inside torch.compile; "
            f"call megacann.ops.selection({device_type!r}) (or run one eager step) before compiling"
        )
    impl = _choose(op, device_type)
    fn = _in_fp32(impl.fn, _SPECS[op].fp32_result) if op in _FP32 else impl.fn
    _CACHE[key] = (impl, fn)
    return fn


def _choose(op: str, device_type: str) -> OpImpl:
    impls = _impls(op)
    pinned = _PINNED.get(op) or _PIN_ALL
    if pinned is None and _FUSED is not None and op not in _FUSED:
        pinned = REFERENCE
    if pinned is not None and pinned in impls:
        impl = impls[pinned]
        if not (impl.serves(device_type) and _is_available(impl)):
            raise RuntimeError(f"op {op!r} is pinned to {pinned!r}, which is not available on {device_type}")
    else:
        candidates = [i for i in impls.values() if i.serves(device_type) and _is_available(i)]
        if not candidates:
            raise RuntimeError(f"op {op!r} has no implementation available on {device_type}")
        impl = max(candidates, key=lambda i: i.priority)
    return impl


def selected(op: str, device_type: str) -> str:
    """Name of the implementation :func:`resolve` picks."""
    resolve(op, device_type)
    return _CACHE[(op, device_type)][0].name


def refresh() -> None:
    """Forget every cached choice and availability check, so the next call of each op chooses again (for
    switches an availability check reads, like :func:`megacann.ops.bf16_matmul.forced`)."""
    _CACHE.clear()
    _AVAILABLE.clear()


def pin(op: Optional[str], name: Optional[str]) -> None:
    """Force implementation ``name`` for ``op`` (``op=None``: for every op that has it; ``name=None``
    undoes the pin). ``pin(None, "reference")`` turns every fused kernel off."""
    global _PIN_ALL
    if op is None:
        _PIN_ALL = name
    else:
        if name is not None and name not in _impls(op):
            raise KeyError(f"op {op!r} has no implementation {name!r}; known: {implementations(op)}")
        if name is None:
            _PINNED.pop(op, None)
        else:
            _PINNED[op] = name
    _CACHE.clear()


# -- fp32 ops ------------------------------------------------------------------------------------------


def _in_fp32(fn: Callable, fp32_result: bool) -> Callable:
    """``fn`` computing in fp32: bf16/fp16 tensor arguments are upcast, and floating results are cast back
    to the dtype of the first upcast argument (unless the op's results are fp32 by contract)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        low = next((a.dtype for a in (*args, *kwargs.values()) if _is_low(a)), None)
        if low is None:
            return fn(*args, **kwargs)
        out = fn(*(_up(a) for a in args), **{k: _up(v) for k, v in kwargs.items()})
        return out if fp32_result else _cast_back(out, low)

    return run


def _is_low(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION


def _up(value: Any) -> Any:
    return value.float() if _is_low(value) else value


def _cast_back(out: Any, dtype: torch.dtype) -> Any:
    if isinstance(out, torch.Tensor):
        return out.to(dtype) if out.dtype == torch.float32 else out
    if isinstance(out, (tuple, list)):
        return type(out)(_cast_back(o, dtype) for o in out)
    return out


# -- recipe selection ----------------------------------------------------------------------------------


def fused_enabled(op: str) -> bool:
    """Whether ``precision.fused_ops`` lets ``op`` use a fused implementation (for callers that choose
    between a fused op and an unfused composition, like the output head's loss)."""
    return _FUSED is None or op in _FUSED


def check_op_names(key: str, names: Sequence[str]) -> list[str]:
    """``names`` if every one is a registered op; TypeError / ValueError naming ``key`` and the valid ops."""
    return _check_names(key, names)


def _check_names(key: str, names: Sequence[str]) -> list[str]:
    if isinstance(names, (str, bytes)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{key} must be a list of op names, got {names!r}; valid op names: {ops()}")
    unknown = [n for n in names if n not in _SPECS]
    if unknown:
        raise ValueError(f"{key}: unknown op name(s) {unknown}; valid op names: {ops()}")
    return list(names)


def configure(fused_ops: Union[bool, Sequence[str]] = True, fp32_ops: Sequence[str] = ()) -> None:
    """Apply ``precision.fused_ops`` and ``precision.fp32_ops``.

    ``fused_ops``: True lets every op use its best available implementation; False pins the PyTorch
    reference everywhere; a list lets only those ops use a fused implementation (the others run the
    reference). ``fp32_ops``: the listed ops compute in fp32 whatever the model precision. Unknown names
    raise ValueError listing the valid ones. Pins set with :func:`pin` still take precedence.
    """
    global _FUSED, _FP32
    if isinstance(fused_ops, bool):
        fused = None if fused_ops else frozenset()
    elif fused_ops is None:
        raise TypeError(f"fused_ops must be true, false or a list of op names; valid op names: {ops()}")
    else:
        fused = frozenset(_check_names("fused_ops", fused_ops))
    fp32 = frozenset(_check_names("fp32_ops", fp32_ops or ()))
    _FUSED, _FP32 = fused, fp32
    _CACHE.clear()


def fp32_ops() -> list[str]:
    """The ops that currently compute in fp32."""
    return sorted(_FP32)


def selection(device_type: str) -> dict[str, str]:
    """``{op: implementation}`` that each op resolves to on ``device_type`` (``" (fp32)"`` appended for the
    fp32 ops; ``"unavailable"`` where nothing serves the device)."""
    chosen = {}
    for op in ops():
        try:
            name = selected(op, device_type)
        except RuntimeError:
            name = "unavailable"
        chosen[op] = name + (" (fp32)" if op in _FP32 else "")
    return chosen


def selection_line(device_type: str) -> str:
    """One line naming the implementation of every op on ``device_type``, for the start of a run."""
    return f"megacann.ops on {device_type}: " + ", ".join(f"{op}={name}" for op, name in selection(device_type).items())


def log_selection(device_type: str) -> str:
    """Log :func:`selection_line` once (logger ``megacann.ops``, level INFO) and return it."""
    line = selection_line(device_type)
    logger.info(line)
    return line
