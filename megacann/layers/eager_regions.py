"""Functions that run eagerly under ``torch.compile`` (a graph break around them), marked without importing
``torch._dynamo``.

``torch.compiler.disable`` imports ``torch._dynamo`` when it is applied, about a second of CPU per process;
as a decorator at module level every rank of every run would pay it, compiled or not. Here the mark is
applied when compiling starts: :meth:`TransformerBlock.compile_forward` (hence ``compile_blocks``) calls
:func:`arm_eager_regions` before ``torch.compile``. Code that calls ``torch.compile`` on megacann modules by itself calls it first too.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)
_REGIONS: list[tuple[Callable, list]] = []


def eager_under_compile(fn: F) -> F:
    """``fn`` (a function or method) that runs eagerly under ``torch.compile`` once armed."""
    impl = [fn]

    @functools.wraps(fn)
    def region(*args, **kwargs):
        return impl[0](*args, **kwargs)

    _REGIONS.append((fn, impl))
    if "torch._dynamo" in sys.modules:  # compile already in use in this process: mark it now
        impl[0] = torch.compiler.disable(fn)
    return region  # type: ignore[return-value]


def arm_eager_regions() -> None:
    """Mark every region ``torch.compiler.disable``d (imports ``torch._dynamo``)."""
    for fn, impl in _REGIONS:
        if impl[0] is fn:
            impl[0] = torch.compiler.disable(fn)
