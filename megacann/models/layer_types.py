"""``layer_types``: the per-layer kind list of the hybrid families (gpt-oss's sliding / full attention,
Qwen3.5's linear / full attention), checked once for all of them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megacann.config import ConfigError


def check_layer_types(types: Any, num_layers: int, known: Sequence[str], family: str, what: str, source: str) -> None:
    """``types`` (None: the family's default) must be a list of ``num_layers`` kinds, each one of ``known``;
    errors name ``source``, the index and the value (``what``: what each entry is, e.g. "attention kind")."""
    if types is None:
        return
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"{source}: layer_types must list one {what} per layer ({num_layers}), got {types!r}")
    for i, kind in enumerate(types):
        if kind not in known:
            raise ConfigError(
                f"{source}: layer_types[{i}] {kind!r} is not implemented by megacann's {family} "
                f"(expected one of {tuple(known)})"
            )
