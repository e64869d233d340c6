"""A stand-in ``torch_npu`` for testing megacann's NPU route on CPU.

Each function has torch_npu's documented signature (an unknown keyword argument is a TypeError, as on the
real module), records its call (name, and the positional and keyword arguments as passed), checks the
documented limits (layouts, ``sparse_mode`` values, head counts against shapes, ``keep_prob`` in (0, 1],
head dims, dtypes, list lengths, row counts) and computes what the documentation says the kernel computes,
written here independently of megacann's reference ops. A wrong call therefore gives a wrong result, a
TypeError or an AssertionError, not a silent pass.

``make_fake_torch_npu(old_api=...)`` plays an older release, one missing feature at a time (:data:`OLD_APIS`):

- ``True`` / ``"cann7.0"`` (``__version__`` "2.1.0"): ``npu_rotary_mul`` has no ``rotary_mode`` (half mode
  only), ``npu_grouped_matmul`` no ``group_type`` / ``group_list_type``, ``npu_fusion_attention`` no TND
  layout and no ``actual_seq_qlen`` / ``actual_seq_kvlen`` (the CANN 7.0 documentation of the operator);
- ``"cann8.0.rc1"``: the TND layout but no ``actual_seq_*`` (the CANN 8.0.RC1 documentation);
- ``"group_type_2_refused"``: the newest signatures, but ``npu_grouped_matmul(group_type=2)`` raises the
  RuntimeError some CANN builds give ("group_type currently only support -1 and 0, current value is 2");
- ``"no_incre_attention"``: the newest signatures, but no ``npu_incre_flash_attention`` (decoding).

The kernels live by area: :mod:`.elementwise` (norm, rotary, SwiGLU, cross entropy, AdamW),
:mod:`.attention` (``npu_fusion_attention`` and its backward, dropout), :mod:`.moe` (grouped matmul, token
permutation), :mod:`.decode` (``npu_incre_flash_attention``); :mod:`.contract` holds the releases and
the strict call wrapper.
"""

from __future__ import annotations

import sys
import types
from typing import Union

import fake_npu_quant

from . import attention, decode, elementwise, moe
from .contract import (
    COMPRESSED,
    GROUP_TYPE_2_REFUSAL,
    NEW_VERSION,
    OLD_APIS,
    OLD_VERSION,
    Call,
    Release,
    strict,
)

__all__ = [
    "COMPRESSED",
    "GROUP_TYPE_2_REFUSAL",
    "NEW_VERSION",
    "OLD_APIS",
    "OLD_VERSION",
    "Call",
    "Release",
    "forget_npu_checks",
    "install",
    "make_fake_torch_npu",
    "route_cpu_to_npu",
    "uninstall",
]
AREAS = (elementwise, attention, moe, decode, fake_npu_quant)


def make_fake_torch_npu(old_api: Union[bool, str] = False) -> types.ModuleType:
    """A fresh fake module (``calls`` starts empty); ``old_api`` names the older release it plays
    (:data:`OLD_APIS`; ``True``: CANN 7.0 with torch_npu 2.1.0's signatures)."""
    release = OLD_APIS[old_api]
    npu = types.ModuleType("torch_npu")
    npu.__version__ = release.version
    npu.calls = []
    for area in AREAS:
        for fn in area.kernels(npu, release):
            setattr(npu, fn.__name__, strict(npu, fn))
    return npu


def install(monkeypatch, old_api: Union[bool, str] = False) -> types.ModuleType:
    """A fresh fake (playing ``old_api``) as ``torch_npu`` for one test, megacann's answers about the
    previous one dropped; :func:`uninstall` (or the monkeypatch's undo) takes it away."""
    npu = make_fake_torch_npu(old_api=old_api)
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    forget_npu_checks()
    return npu


def uninstall(monkeypatch) -> None:
    """No ``torch_npu`` any more, and megacann's answers about the fake dropped."""
    monkeypatch.delitem(sys.modules, "torch_npu")
    forget_npu_checks()


def forget_npu_checks() -> None:
    """Drop megacann's cached torch_npu import and NPU availability answers (after swapping the module)."""
    from megacann import accelerator
    from megacann.ops import npu_api, registry

    accelerator.import_torch_npu.cache_clear()
    npu_api.forget()
    for key in [k for k in registry._AVAILABLE if k[1] in ("npu", "torch_npu")]:
        del registry._AVAILABLE[key]
    registry._CACHE.clear()


def route_cpu_to_npu() -> None:
    """Make every megacann op called on CPU tensors resolve as on an NPU (for a whole model on the fake):
    each public op function looks its implementation up through its own ``_resolve``."""
    from megacann import ops
    from megacann.ops import registry

    def as_npu(op: str, device_type: str):
        return registry.resolve(op, "npu" if device_type == "cpu" else device_type)

    for name in registry.ops():
        fn = getattr(ops, name, None)
        if fn is not None and hasattr(fn, "spec"):
            fn.__globals__["_resolve"] = as_npu
