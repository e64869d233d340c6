"""Deterministic permutations that are the same on every machine and NumPy version.

NumPy does not promise that ``Generator.permutation`` keeps its stream across releases, and data order
is part of a run's reproducibility, so orders here come from sorting SplitMix64 hashes of the element
indices, keyed by the seed (and epoch, split, ...): pure integer arithmetic, identical everywhere.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix_int(x: int) -> int:
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _mix_array(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def seed_key(*parts: int) -> int:
    """Fold integers (seed, epoch, ...) into one 64-bit key."""
    key = 0
    for part in parts:
        key = _mix_int((key ^ (int(part) & _MASK)) + _GOLDEN)
    return key


def hash_indices(n: int, *parts: int) -> np.ndarray:
    """uint64 pseudo-random values for indices 0..n-1, a pure function of (index, parts)."""
    with np.errstate(over="ignore"):
        x = (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(_GOLDEN)) + np.uint64(seed_key(*parts))
    return _mix_array(x)


def permutation(n: int, *parts: int) -> np.ndarray:
    """A permutation of ``range(n)`` determined by ``parts`` alone (int64; int32 would do but costs casts)."""
    order = np.argsort(hash_indices(n, *parts), kind="stable")
    return order.astype(np.int64, copy=False)
