"""Running megacann's commands as a user does: console scripts of this interpreter's environment, and a
child environment on CPU without the variables of an enclosing torchrun."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def console_script(name: str) -> str:
    """The installed console script ``name`` (megacann-train, megacann-plan, ...)."""
    return os.path.join(os.path.dirname(sys.executable), name)


def user_env(extra: dict | None = None) -> dict[str, str]:
    """os.environ on CPU with one thread per process, torchrun's variables removed, ``extra`` on top."""
    env = {**os.environ, "MEGACANN_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    for key in (*TORCHRUN_VARS, "PYTEST_ADDOPTS"):
        env.pop(key, None)
    env.update(extra or {})
    return env
