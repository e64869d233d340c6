"""Recipe advice: one plain line on stderr, not a Python warning (which would add a stray source line).

Advice is printed once per process and only where it is read: on rank 0 (or outside torchrun). A launcher
that already showed it before starting ranks sets ``MEGACANN_ADVICE_SHOWN=1`` so the ranks stay quiet.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

ADVICE_SHOWN_ENV = "MEGACANN_ADVICE_SHOWN"
_shown: set[str] = set()


def advise(message: str) -> None:
    """Print ``megacann: note: <message>`` to stderr, once per process, on rank 0 only."""
    if message in _shown or os.environ.get("RANK", "0") != "0" or os.environ.get(ADVICE_SHOWN_ENV) == "1":
        return
    _shown.add(message)
    print(f"megacann: note: {message}", file=sys.stderr, flush=True)


def forget_advice() -> None:
    """Let advice already shown in this process be shown again (for a new recipe in a long-lived process)."""
    _shown.clear()


@contextlib.contextmanager
def quiet_advice() -> Iterator[None]:
    """No advice inside the block (a planner validating many candidate layouts)."""
    saved = os.environ.get(ADVICE_SHOWN_ENV)
    os.environ[ADVICE_SHOWN_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ADVICE_SHOWN_ENV, None)
        else:
            os.environ[ADVICE_SHOWN_ENV] = saved
