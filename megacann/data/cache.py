"""Cache directories, an inter-process file lock and atomic writes for data indices and the default corpus.

Several ranks (or nodes on a shared file system) may start together and find the same cache missing. The
first to take the lock builds; the others wait and then load. Every file is written under a temporary
name and renamed into place, so a reader never sees a half-written file even where ``flock`` is not
honoured (some network file systems): there every rank builds the same bytes and the last rename wins.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Callable, Optional

import numpy as np

try:  # POSIX only; elsewhere atomic renames alone keep the cache consistent.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]


def cache_root(cache_dir: Optional[str] = None) -> str:
    """``cache_dir``, else ``$MEGACANN_CACHE``, else ``~/.cache/megacann``."""
    root = cache_dir or os.environ.get("MEGACANN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megacann")
    return os.path.abspath(root)


def writable_dir(path: str) -> bool:
    """True when files can be created in ``path`` (creating it if needed)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def digest(*parts: object, length: int = 16) -> str:
    """A short stable hex digest of the ``repr`` of ``parts``."""
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\x00")
    return h.hexdigest()[:length]


def file_digest(path: str, length: int = 16) -> str:
    """Hex digest of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:length]


@contextlib.contextmanager
def file_lock(path: str, timeout: float = 3600.0) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the ``with`` block."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a+") as handle:
        if fcntl is not None:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"could not lock {path} within {timeout:.0f} s (a stuck builder?)") from None
                    time.sleep(0.05)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def atomic_save_npz(path: str, **arrays: np.ndarray) -> None:
    """Write ``arrays`` to ``path`` (.npz) through a temporary file and a rename."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def cached_arrays(path: str, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Load the arrays cached at ``path``; build and save them first (under a lock) when missing."""
    if os.path.exists(path):
        return _load(path)
    with file_lock(path + ".lock"):
        if os.path.exists(path):  # another rank built it while we waited
            return _load(path)
        arrays = build()
        atomic_save_npz(path, **arrays)
    return arrays


def _load(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def publish_dir(tmp: str, directory: str) -> None:
    """Rename the finished folder ``tmp`` to ``directory``; if another process (on a file system where the
    lock is not honoured) got there first, keep theirs (identical by construction) and drop ours."""
    try:
        os.replace(tmp, directory)
    except OSError:
        if not os.path.isdir(directory):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def cached_npy_dir(directory: str, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Like :func:`cached_arrays`, but one ``.npy`` per array in ``directory``, loaded memory-mapped (so
    DataLoader workers share the pages). The folder is filled under a temporary name and renamed."""
    if not os.path.isdir(directory):
        with file_lock(directory + ".lock"):
            if not os.path.isdir(directory):
                arrays = build()
                parent = os.path.dirname(os.path.abspath(directory))
                os.makedirs(parent, exist_ok=True)
                tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
                try:
                    for key, array in arrays.items():
                        np.save(os.path.join(tmp, key + ".npy"), array)
                    publish_dir(tmp, directory)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
    names = sorted(f[:-4] for f in os.listdir(directory) if f.endswith(".npy"))
    return {name: _load_npy(os.path.join(directory, name + ".npy")) for name in names}


def _load_npy(path: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r")
    except ValueError:  # an empty array cannot be memory-mapped
        return np.load(path)
