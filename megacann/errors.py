"""The base of every error megacann reports to a user.

An error that derives from :class:`MegacannError` carries a message that names the file, key, path or
rank at fault and what would fix it; ``megacann-train`` and the other commands print that message as one
line and exit with ``exit_code`` instead of a traceback. Anything else that escapes is a bug and keeps its
traceback. Each module keeps its own error class (``ConfigError``, ``IndexedDatasetError``, ...), derived
from this one and from the built-in type it has always been (``ValueError``, ``RuntimeError``).
"""

from __future__ import annotations


class MegacannError(Exception):
    """An input or a run that megacann cannot go on with; the message says what and how to fix it."""

    exit_code = 2  # bad input found before training; failures during training use 1


class TrainingAborted(MegacannError, RuntimeError):
    """Training stopped on purpose (e.g. too many consecutive skipped steps); nothing new was saved."""

    exit_code = 1
