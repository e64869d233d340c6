"""Host memory policy for CPU training: keep freed blocks in the process instead of handing them back.

glibc's malloc serves a request above its mmap threshold (adaptive, at most 32 MiB) with a fresh mapping,
and returns free memory at the top of its heap to the kernel once it exceeds the trim threshold. A training
step frees and allocates the same tens of MiB every step, so on glibc's defaults it keeps getting fresh
pages, which the kernel zero-fills one 4 KiB page at a time on first touch: how many depends on the heap's
history, and cost a CPU MoE layer up to ~15 % of its step (benchmarks/NOTES.md, issue 28). A CPU run
therefore fixes the thresholds when it starts (:func:`megacann.training.runtime.setup_runtime`): requests
up to 32 MiB, glibc's largest threshold, come from the heap, and freed memory stays mapped for the next
step, so the process holds its peak heap between steps instead of returning it.

``MEGACANN_HOST_MALLOC=system`` keeps glibc's defaults (set it when the program tunes malloc itself
through ``mallopt``, which cannot be seen from here); so does a malloc setting in the environment
(``MALLOC_*_`` variables, ``GLIBC_TUNABLES`` naming malloc). Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Optional

OPT_OUT_VARIABLE = "MEGACANN_HOST_MALLOC"  # "system": leave the C library's defaults
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")

# mallopt parameters (malloc.h) and the values set
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: bigger requests are mapped whatever is asked
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: free memory up to 2 GiB at the heap's top stays mapped
TOP_PAD = 64 << 20  # the heap grows by at least this much at a time

_applied: Optional[bool] = None


def _declined() -> Optional[str]:
    """Why the policy is not applied here, or None."""
    choice = os.environ.get(OPT_OUT_VARIABLE, "").strip().lower()
    if choice not in ("", "keep", "system"):
        raise ValueError(f"{OPT_OUT_VARIABLE}={choice!r}: expected 'keep' (the default) or 'system'")
    if choice == "system":
        return f"{OPT_OUT_VARIABLE}=system"
    mine = [name for name in USER_SETTINGS if name in os.environ]
    if "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        mine.append("GLIBC_TUNABLES")
    if mine:
        return "the environment sets " + ", ".join(mine)
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not Linux with glibc"
    return None


def keep_freed_host_memory() -> bool:
    """Apply the policy to this process (once; later calls return the first answer). True when applied."""
    global _applied
    if _applied is None:
        declined = _declined()
        _applied = False
        if declined is None:
            libc = ctypes.CDLL(None)  # the C library this process already uses
            settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
            _applied = all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
    return _applied
