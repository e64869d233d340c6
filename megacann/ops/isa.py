"""Which compiled variant of megacann's C++ kernel loops runs: ``baseline`` (portable), ``avx2`` (x86-64-v3:
AVX2 + FMA) or ``avx512`` (x86-64-v4). The library holds every variant its build made (see
:mod:`megacann.ops.extension`); at load the best one this CPU runs is chosen, never above PyTorch's own
CPU capability (``ATEN_CPU_CAPABILITY=avx2`` holds megacann's kernels to AVX2 as well).
``MEGACANN_CPU_ISA=baseline|avx2|avx512`` forces one (for tests and benchmarks); a variant the build lacks
or the CPU cannot run is refused with a message naming what is missing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Optional

logger = logging.getLogger("megacann.ops")

ISA_ENV = "MEGACANN_CPU_ISA"
ISA_NAMES = ("baseline", "avx2", "avx512")  # the codes of csrc/isa.cpp, in order
_V3 = frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm", "xsave"})
REQUIRED_FLAGS = {
    "baseline": frozenset(),
    "avx2": _V3,
    "avx512": _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
# torch.backends.cpu.get_cpu_capability() -> the highest variant it allows
_TORCH_CAPS = {"DEFAULT": "baseline", "NO AVX": "baseline", "AVX2": "avx2", "AVX512": "avx512"}
# The highest variant chosen without MEGACANN_CPU_ISA: the AVX-512 loops' 16-lane reductions round differently
# enough that a MoE + multi-token-prediction run at tp 2 + SP drifted 1.07e-5 (relative) from one process after
# a few steps, above megacann's 1e-5 parity bound (the AVX2 and baseline loops stay within it); opt in with
# MEGACANN_CPU_ISA=avx512 (the kernels are ~5% of a CPU step).
AUTO_MAX = "avx2"


def cpu_flags(cpuinfo: Optional[str] = None) -> frozenset[str]:
    """The first core's feature flags from ``/proc/cpuinfo`` (x86 ``flags``, ARM ``Features``; empty where
    there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return frozenset()


def choose_isa(
    flags: Iterable[str],
    built: Iterable[str],
    torch_capability: Optional[str] = None,
    forced: Optional[str] = None,
) -> str:
    """The variant to run: ``forced`` (the ``MEGACANN_CPU_ISA`` value; ``""``/``auto`` = choose) if the build has
    it and the CPU's ``flags`` cover it, else the highest of ``built`` the flags cover and PyTorch's capability
    (``torch.backends.cpu.get_cpu_capability()``; unknown values cap nothing) allows, at most :data:`AUTO_MAX`."""
    flags, built = frozenset(flags), tuple(built)
    want = (forced or "").strip().lower()
    if want not in ("", "auto"):
        if want not in ISA_NAMES:
            raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {('auto',) + ISA_NAMES}")
        if want not in built:
            raise ValueError(f"{ISA_ENV}={want}: this build of megacann's kernels has only {built}")
        missing = sorted(REQUIRED_FLAGS[want] - flags)
        if missing:
            raise ValueError(f"{ISA_ENV}={want}: this CPU lacks {', '.join(missing)}")
        return want
    cap = ISA_NAMES.index(_TORCH_CAPS.get((torch_capability or "").upper(), ISA_NAMES[-1]))
    cap = min(cap, ISA_NAMES.index(AUTO_MAX))
    usable = [n for n in ISA_NAMES[: cap + 1] if n in built and REQUIRED_FLAGS[n] <= flags]
    return usable[-1] if usable else "baseline"


def built_variants() -> tuple[str, ...]:
    """The variants the loaded library holds and this CPU runs (the library must be loaded)."""
    import torch

    if not hasattr(torch.ops.megacann, "cpu_isa_available"):  # a library built before the variants existed
        return ("baseline",)
    mask = int(torch.ops.megacann.cpu_isa_available())
    return tuple(name for code, name in enumerate(ISA_NAMES) if mask >> code & 1)


def current() -> str:
    """The variant in use."""
    import torch

    return ISA_NAMES[int(torch.ops.megacann.cpu_isa())]


def set_isa(name: str) -> str:
    """Run variant ``name`` from now on; returns the previous one."""
    import torch

    if name not in ISA_NAMES:
        raise ValueError(f"kernel variant {name!r}: expected one of {ISA_NAMES}")
    return ISA_NAMES[int(torch.ops.megacann.set_cpu_isa(ISA_NAMES.index(name)))]


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """Run variant ``name`` inside the block (tests, benchmarks)."""
    previous = set_isa(name)
    try:
        yield
    finally:
        set_isa(previous)


def select() -> str:
    """Choose and set the variant for this process (:func:`choose_isa` on this CPU, PyTorch's capability
    and ``MEGACANN_CPU_ISA``); called once when the library loads."""
    import torch

    built = built_variants()
    name = choose_isa(cpu_flags(), built, torch.backends.cpu.get_cpu_capability(), os.environ.get(ISA_ENV))
    if built != ("baseline",):  # a library without variants has nothing to switch (and may lack the op)
        set_isa(name)
    logger.debug("megacann C++ kernels: %s variant", name)
    return name
