"""Which torch_npu API the installed release offers, per op, so that an older torch_npu falls back op by op
instead of failing at the first step.

megacann's NPU kernels call two arguments that older torch_npu releases lack: ``npu_rotary_mul``'s
``rotary_mode`` (older releases: ``npu_rotary_mul(x, r1, r2)``, half mode only) and ``npu_grouped_matmul``'s
``group_type`` (the weight gradient splits the contraction with ``group_type=2``). :func:`supports` reads the
function's signature (``inspect.signature``; for a compiled operator without one, the schema torch_npu
registers as ``torch.ops.npu.<name>``) and, when the
argument is missing, logs one line (logger ``megacann.ops``, WARNING) naming the op, the implementation
that stands down, the torch_npu version and the missing argument; the registry then resolves the op to
its next implementation. A signature that cannot be read at all counts as the documented newest API.
"""

from __future__ import annotations

import inspect
import logging
import re
from typing import Any, Callable, Optional

import torch

from megacann.accelerator import import_torch_npu

logger = logging.getLogger("megacann.ops")


def _operator_schema(name: str) -> Optional[str]:
    """The schema torch_npu registers for ``torch.ops.npu.<name>`` (its argument names), if any."""
    try:
        return str(getattr(torch.ops.npu, name).default._schema)
    except Exception:  # no such namespace / operator / overload here
        return None


def accepts(fn: Callable[..., Any], parameter: str) -> Optional[bool]:
    """Whether ``fn`` takes an argument named ``parameter``: from its Python signature, else from its
    operator schema (``fn._schema``, or ``torch.ops.npu.<fn.__name__>``'s); None when neither is there."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        schema = getattr(fn, "_schema", None) or _operator_schema(getattr(fn, "__name__", ""))
        return None if schema is None else re.search(rf"\b{re.escape(parameter)}\b", str(schema)) is not None
    return parameter in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def version() -> str:
    """The torch_npu version string ("none" without torch_npu, "unknown" when it has none)."""
    npu = import_torch_npu()
    return "none" if npu is None else str(getattr(npu, "__version__", "unknown"))


def supports(op: str, impl: str, function: str, parameter: Optional[str] = None) -> bool:
    """True when torch_npu has ``function`` (taking ``parameter``, if given) for implementation ``impl``
    of ``op``; otherwise log the one line saying what falls back and why, and return False. The registry
    calls this once per (op, implementation) and caches the answer."""
    npu = import_torch_npu()
    if npu is None:
        return False
    fn = getattr(npu, function, None)
    if fn is None:
        why = f"it has no {function}"
    elif parameter is not None and accepts(fn, parameter) is False:
        why = f"its {function} takes no {parameter!r} (an older API)"
    else:
        return True
    logger.warning(
        "megacann.ops: %s falls back from %r to its next implementation: torch_npu %s found, %s",
        op, impl, version(), why,
    )  # fmt: skip
    return False
