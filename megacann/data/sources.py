"""What ``data.path`` (and ``data.weights``) name: a list of (weight or None, file path) entries.

Accepted forms of ``data.path``:

* a prefix of a ``.bin``/``.idx`` pair (``x``, ``x.bin`` or ``x.idx``), or a JSONL file for SFT;
* a directory: every pair in it (every ``*.jsonl`` for SFT), sorted by name;
* a list of those;
* a Megatron-style blend list ``[w1, p1, w2, p2, ...]``.

Weights come from the blend list or from ``data.weights`` (one per entry, after directories expand), not
both. Entries without weights are blended in proportion to their size in tokens (pretraining) or samples
(SFT), which reads them as one concatenated corpus.
"""

from __future__ import annotations

import os
from typing import Optional, Union

from megacann.data.indexed_dataset import exists, strip_suffix
from megacann.errors import MegacannError


class DataPathError(MegacannError, ValueError):
    """A ``data.path`` / ``data.weights`` that names no usable data."""


def _is_number(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


def _expand(path: str, sft: bool) -> list[str]:
    path = os.path.expanduser(str(path))
    if os.path.isdir(path):
        if sft:
            found = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith((".jsonl", ".json")))
            kind = "*.jsonl files"
        else:
            names = sorted(f[:-4] for f in os.listdir(path) if f.endswith(".idx"))
            found = [os.path.join(path, n) for n in names if exists(os.path.join(path, n))]
            kind = ".bin/.idx pairs"
        if not found:
            raise DataPathError(f"data.path: directory {path!r} holds no {kind}")
        return found
    if sft:
        if not os.path.isfile(path):
            raise DataPathError(
                f"data.path: SFT file {path!r} not found (expected a JSONL file or a directory of them)"
            )
        return [path]
    prefix = strip_suffix(path)
    if not exists(prefix):
        raise DataPathError(
            f"data.path: {path!r} is not a .bin/.idx pair (looked for {prefix}.bin and {prefix}.idx) nor a directory"
        )
    return [prefix]


def resolve_sources(
    path: Union[str, list, None], weights: Optional[list] = None, sft: bool = False
) -> list[tuple[Optional[float], str]]:
    """The (weight, path) entries named by ``data.path`` and ``data.weights``; weight None = by size."""
    if path is None:
        raise DataPathError("data.path is not set")
    items = list(path) if isinstance(path, (list, tuple)) else [path]
    if not items:
        raise DataPathError("data.path is an empty list")
    blend_weights: Optional[list[float]] = None
    if len(items) % 2 == 0 and all(_is_number(items[i]) for i in range(0, len(items), 2)):
        if weights is not None:
            raise DataPathError(
                "data.path is a blend list [w1, p1, w2, p2, ...]; give weights there or in data.weights, not both"
            )
        blend_weights = [float(items[i]) for i in range(0, len(items), 2)]
        items = [items[i] for i in range(1, len(items), 2)]
    for item in items:
        if not isinstance(item, str):
            raise DataPathError(f"data.path: {item!r} is not a path (expected strings, or [weight, path, ...] pairs)")
    if blend_weights is not None:
        entries: list[tuple[Optional[float], str]] = []
        for w, item in zip(blend_weights, items):
            expanded = _expand(item, sft)
            entries += [(w / len(expanded), p) for p in expanded]  # a directory's weight is shared by its files
        return entries
    paths = [p for item in items for p in _expand(item, sft)]
    if weights is None:
        return [(None, p) for p in paths]
    if len(weights) != len(paths) or not all(_is_number(w) for w in weights):
        raise DataPathError(
            f"data.weights: {weights!r} must be {len(paths)} numbers, one per dataset of data.path ({paths})"
        )
    return [(float(w), p) for w, p in zip(weights, paths)]
