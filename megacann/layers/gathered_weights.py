"""Holding a model chunk's weights whole for a phase of many forwards.

ZeRO-3 keeps each rank's shard of the weights and gathers a block's whole weights around each forward
(``megacann.optimizer.zero``). A phase of many small forwards without a backward (generation: a prefill
and a decode step a token) would gather and free every block for every step; instead, the code that
shards a chunk registers here how to hold its weights gathered, and such a phase enters
:func:`weights_gathered` once: gathered at the start, freed at the end. A chunk nobody registered holds
its weights already; the context then does nothing.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Callable

import torch

_HOLDERS: weakref.WeakKeyDictionary[torch.nn.Module, Callable[[], AbstractContextManager[None]]] = (
    weakref.WeakKeyDictionary()
)


def register_weight_holder(chunk: torch.nn.Module, hold: Callable[[], AbstractContextManager[None]]) -> None:
    """``hold()`` is a context inside which ``chunk``'s weights stay whole through any number of forwards."""
    _HOLDERS[chunk] = hold


@contextlib.contextmanager
def weights_gathered(chunk: torch.nn.Module) -> Iterator[None]:
    """``chunk``'s weights whole inside the block, gathered once (when they are sharded) and freed after."""
    hold = _HOLDERS.get(chunk)
    with hold() if hold is not None else contextlib.nullcontext():
        yield
