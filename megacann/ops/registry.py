"""A small registry of fused operators: several implementations per op, chosen per device type.

Every op has a PyTorch ``reference`` implementation that runs anywhere. Faster ones (torch_npu kernels,
the C++ extension in ``csrc/``, CUDA kernels) register under the same op name with a priority, the device
types they serve and an availability check; the check runs once, lazily, on first use, so registering
never imports an optional package. :func:`resolve` returns the highest-priority available implementation
for a device type and caches the answer; :func:`pin` forces one (tests, benchmarks, ``precision.fused_ops``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

REFERENCE = "reference"


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


_IMPLS: dict[str, dict[str, OpImpl]] = {}
_PINNED: dict[str, str] = {}
_PIN_ALL: Optional[str] = None
_CACHE: dict[tuple[str, str], Callable] = {}
_AVAILABLE: dict[tuple[str, str], bool] = {}


def register(
    op: str,
    name: str,
    *,
    priority: int = 0,
    device_types: Optional[tuple[str, ...]] = None,
    available: Optional[Callable[[], bool]] = None,
) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as implementation ``name`` of ``op``. Higher priority wins; the
    reference implementation has priority 0."""

    def decorate(fn: Callable) -> Callable:
        impl = OpImpl(op, name, fn, priority, frozenset(device_types) if device_types else None, available or _always)
        _IMPLS.setdefault(op, {})[name] = impl
        _CACHE.clear()
        return fn

    return decorate


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
    return sorted(_IMPLS)


def implementations(op: str) -> list[str]:
    """Names of the implementations registered for ``op``, best first."""
    return [i.name for i in sorted(_impls(op).values(), key=lambda i: -i.priority)]


def _impls(op: str) -> dict[str, OpImpl]:
    if op not in _IMPLS:
        raise KeyError(f"unknown op {op!r}; registered ops: {ops()}")
    return _IMPLS[op]


def resolve(op: str, device_type: str) -> Callable:
    """The implementation of ``op`` to use on ``device_type`` (cached)."""
    key = (op, device_type)
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    impls = _impls(op)
    pinned = _PINNED.get(op) or _PIN_ALL
    if pinned is not None and pinned in impls:
        impl = impls[pinned]
        if not (impl.serves(device_type) and _is_available(impl)):
            raise RuntimeError(f"op {op!r} is pinned to {pinned!r}, which is not available on {device_type}")
    else:
        candidates = [i for i in impls.values() if i.serves(device_type) and _is_available(i)]
        if not candidates:
            raise RuntimeError(f"op {op!r} has no implementation available on {device_type}")
        impl = max(candidates, key=lambda i: i.priority)
    _CACHE[key] = impl.fn
    return impl.fn


def selected(op: str, device_type: str) -> str:
    """Name of the implementation :func:`resolve` picks."""
    fn = resolve(op, device_type)
    return next(i.name for i in _impls(op).values() if i.fn is fn)


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
