"""Checkpoint directories on disk: naming, the completion marker, ``latest``, rotation."""

from __future__ import annotations

import os
import re
import shutil
from typing import Optional

COMPLETE_MARKER = "COMPLETE"
LATEST_FILE = "latest"
_NAME = re.compile(r"^checkpoint_(\d+)$")


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"checkpoint_{step}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def list_complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in ``output_dir``, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _NAME.match(name)
        path = os.path.join(output_dir, name)
        if match and is_complete(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: str) -> Optional[str]:
    """The checkpoint named by ``<output_dir>/latest`` if complete, else the newest complete one."""
    pointer = os.path.join(output_dir, LATEST_FILE)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        path = os.path.join(output_dir, name)
        if name and is_complete(path):
            return path
    found = list_complete_checkpoints(output_dir)
    return found[-1][1] if found else None


def find_resume_checkpoint(output_dir: str, resume_from: Optional[str]) -> Optional[str]:
    """What to resume from: an explicit directory, 'latest', or (automatically) the newest in output_dir."""
    if resume_from is None or resume_from == "latest":
        path = latest_checkpoint(output_dir)
        if resume_from == "latest" and path is None:
            raise FileNotFoundError(f"--resume_from latest: no complete checkpoint in {output_dir!r}")
        return path
    if not os.path.isdir(resume_from):
        raise FileNotFoundError(f"--resume_from {resume_from!r}: no such checkpoint directory")
    if not is_complete(resume_from):
        raise ValueError(f"--resume_from {resume_from!r}: checkpoint is incomplete (no {COMPLETE_MARKER} marker)")
    return resume_from


def write_latest(output_dir: str, path: str) -> None:
    """Point ``latest`` at ``path`` atomically (write a temporary file, then rename)."""
    tmp = os.path.join(output_dir, LATEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(os.path.basename(path) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(output_dir, LATEST_FILE))


def rotate(output_dir: str, keep_last: Optional[int]) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints (never the only one)."""
    if not keep_last or keep_last < 1:
        return []
    found = list_complete_checkpoints(output_dir)
    removed = []
    for _, path in found[: max(0, len(found) - keep_last)]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
