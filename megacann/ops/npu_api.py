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

Two features are narrower than a whole op, so the op keeps its kernel and only that use of it steps aside:

- ``npu_fusion_attention``'s TND layout with ``actual_seq_qlen`` / ``actual_seq_kvlen`` (packed documents):
  the CANN 7.0 and 8.0.RC1 documentation of the operator has no ``actual_seq_*`` (7.0 no TND either), and
  TND is of no use to megacann without them, so one check, :func:`takes`, on ``actual_seq_qlen`` decides;
  without it packed batches run one BSND call per document (:mod:`megacann.ops.npu`), said once when the
  op is resolved (the start of a run);
- ``npu_grouped_matmul(..., group_type=2)`` (the experts' weight gradient, the contraction split by
  group): some CANN builds take the argument and refuse the value at run time ("group_type currently only
  support -1 and 0, current value is 2"); :func:`refused` recognises that refusal, says it once and
  remembers it, and the weight gradient is then computed as one product per expert.

:data:`MINIMUM_TORCH_NPU` and :data:`MINIMUM_CANN` are the oldest releases megacann is meant for (the
torch_npu release for megacann's oldest torch, and the oldest CANN that release is paired with);
:data:`CANN_GAPS` lists what older CANN releases lack. ``scripts/check_env.py`` judges the installed ones.
"""

from __future__ import annotations

import inspect
import logging
import re
from typing import Any, Callable, Optional

import torch

from megacann.accelerator import import_torch_npu

logger = logging.getLogger("megacann.ops")

MINIMUM_TORCH_NPU = "2.7.1"  # torch_npu is built per torch release; megacann needs torch >= 2.7
MINIMUM_CANN = "8.3.RC1"  # the oldest CANN torch_npu 2.7.1 is paired with (Ascend's compatibility table)
CANN_GAPS = (  # (newest CANN release lacking it, what is missing and what megacann does instead)
    ("7.0", "npu_fusion_attention has no TND layout"),
    (
        "8.0.RC1",
        "npu_fusion_attention has no actual_seq_qlen/actual_seq_kvlen: packed documents run one attention "
        "call per document",
    ),
)
GROUP_TYPE_REFUSAL = "group_type currently only support -1 and 0"  # some builds' answer to group_type=2
_answers: dict[tuple[str, str], bool] = {}  # (function, feature) -> supported; cleared by forget()


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


def supports(
    op: str, impl: str, function: str, parameter: Optional[str] = None, instead: str = "its next implementation"
) -> bool:
    """True when torch_npu has ``function`` (taking ``parameter``, if given) for implementation ``impl``
    of ``op``; otherwise log the one line saying what falls back (to ``instead``) and why, and return
    False. The registry calls this once per (op, implementation) and caches the answer."""
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
        "megacann.ops: %s falls back from %r to %s: torch_npu %s found, %s", op, impl, instead, version(), why
    )
    return False


def takes(op: str, impl: str, function: str, parameter: str, instead: str) -> bool:
    """:func:`supports` for one use of an op (``impl``) that falls back to ``instead`` within the op's own
    kernel; asked once per (function, parameter) until :func:`forget`, so it is said once."""
    key = (function, parameter)
    if key not in _answers:
        _answers[key] = supports(op, impl, function, parameter, instead)
    return _answers[key]


def refused(feature: str, error: BaseException, instead: str) -> bool:
    """Whether ``error``, raised by a torch_npu call using ``feature``, is the known refusal of it (for now
    ``group_type=2``, :data:`GROUP_TYPE_REFUSAL`); if so, log once what is done ``instead`` and remember it
    (:func:`was_refused`). Any other error is not a refusal: the caller raises it."""
    if GROUP_TYPE_REFUSAL not in str(error):
        return False
    if _answers.get(("refused", feature)) is None:
        logger.warning("megacann.ops: torch_npu %s refuses %s (%s): %s from now on", version(), feature, error, instead)
    _answers[("refused", feature)] = True
    return True


def was_refused(feature: str) -> bool:
    """Whether torch_npu has refused ``feature`` in this process (see :func:`refused`)."""
    return _answers.get(("refused", feature), False)


def forget() -> None:
    """Drop the answers kept about the installed torch_npu (after it is swapped, in tests)."""
    _answers.clear()
