"""Checkpoint directories on disk: naming, atomic publication, the completion marker, ``latest``, rotation.

A save writes into ``checkpoint_<step>.tmp``; once every file is flushed to disk the marker ``COMPLETE``
is written and synced, the directory is renamed to ``checkpoint_<step>`` (an atomic step: a directory
of that name is always whole), the parent directory is synced, and only then is ``latest`` replaced
(through a temporary file and a rename) and old checkpoints rotated. A process killed at any moment
leaves at worst a ``.tmp`` directory, which is never read and is removed by the next save.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Optional

COMPLETE_MARKER = "COMPLETE"
LATEST_FILE = "latest"
TMP_SUFFIX = ".tmp"
_NAME = re.compile(r"^checkpoint_(\d+)$")
_TMP_NAME = re.compile(r"^checkpoint_(\d+)(\.tmp|\.old)$")


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
        if name and _NAME.match(name) and is_complete(path):
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
        latest = latest_checkpoint(resume_from)  # an output directory given instead of a checkpoint
        if latest is not None:
            return latest
        raise ValueError(f"--resume_from {resume_from!r}: checkpoint is incomplete (no {COMPLETE_MARKER} marker)")
    return resume_from


def fsync_path(path: str) -> None:
    """Flush a file or a directory entry list to disk (directories: where the OS allows it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def write_file_synced(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def remove_stale_temporaries(output_dir: str) -> list[str]:
    """Delete ``checkpoint_<step>.tmp`` / ``.old`` directories left by saves that were killed."""
    removed = []
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            if _TMP_NAME.match(name):
                shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
                removed.append(name)
    return removed


def publish(tmp: str, final: str, step: int) -> None:
    """Mark ``tmp`` complete and rename it to ``final`` (an existing ``final`` is replaced only after
    the new one is complete). The files in ``tmp`` must already be synced to disk."""
    write_file_synced(os.path.join(tmp, COMPLETE_MARKER), f"{step}\n")
    fsync_path(tmp)
    old = None
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_latest(output_dir: str, path: str) -> None:
    """Point ``latest`` at ``path`` atomically (write a temporary file, then rename)."""
    tmp = os.path.join(output_dir, LATEST_FILE + TMP_SUFFIX)
    write_file_synced(tmp, os.path.basename(path) + "\n")
    os.replace(tmp, os.path.join(output_dir, LATEST_FILE))
    fsync_path(output_dir)


def rotate(output_dir: str, keep_last: Optional[int]) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints (never the only one, never the
    one ``latest`` names)."""
    if not keep_last or keep_last < 1:
        return []
    found = list_complete_checkpoints(output_dir)
    keep = latest_checkpoint(output_dir)
    removed = []
    for _, path in found[: max(0, len(found) - keep_last)]:
        if path == keep:
            continue
        doomed = path + ".old"  # out of the complete set in one rename, then deleted at leisure
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed
