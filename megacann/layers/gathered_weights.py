"""Holding a model chunk's weights whole for a phase of many forwards.

ZeRO-3 keeps each rank's shard of the weights and gathers a block's whole weights around each forward
(``megacann.optimizer.zero``). A phase of many small forwards without a backward (generation: a prefill
and a decode step a token) would gather and free every block for every step; instead, the code that
shards a chunk registers here how to hold its weights gathered, and such a phase enters
:func:`weights_gathered` once: gathered at the start, freed at the end. A chunk nobody registered holds
its weights already; the context then does nothing.

A walk over the weights one part at a time (streaming them to a serving engine) enters
:func:`parameters_gathered` per part instead: only the sharded units holding those parameters are whole,
one part at a time.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Callable, Optional

import torch

_HOLDERS: weakref.WeakKeyDictionary[torch.nn.Module, Callable[[], AbstractContextManager[None]]] = (
    weakref.WeakKeyDictionary()
)


_PART_HOLDERS: weakref.WeakKeyDictionary[
    torch.nn.Module, Callable[[Iterable[torch.Tensor]], AbstractContextManager[None]]
] = weakref.WeakKeyDictionary()


def register_weight_holder(
    chunk: torch.nn.Module,
    hold: Callable[[], AbstractContextManager[None]],
    hold_part: Optional[Callable[[Iterable[torch.Tensor]], AbstractContextManager[None]]] = None,
) -> None:
    """``hold()`` is a context inside which ``chunk``'s weights stay whole through any number of forwards;
    ``hold_part(params)`` one inside which those of its parameters (and the rest of their units) are."""
    _HOLDERS[chunk] = hold
    if hold_part is not None:
        _PART_HOLDERS[chunk] = hold_part


@contextlib.contextmanager
def weights_gathered(chunk: torch.nn.Module) -> Iterator[None]:
    """``chunk``'s weights whole inside the block, gathered once (when they are sharded) and freed after."""
    hold = _HOLDERS.get(chunk)
    with hold() if hold is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def parameters_gathered(chunks: Iterable[torch.nn.Module], params: Iterable[torch.Tensor]) -> Iterator[bool]:
    """``params`` (of any of ``chunks``) whole inside the block: the sharded units holding them gathered and
    freed after. Yields whether some chunk's weights are sharded: a tensor kept past the block must then be
    copied (a freed unit's storage is released)."""
    params = list(params)
    holders = [_PART_HOLDERS[chunk] for chunk in chunks if chunk in _PART_HOLDERS]
    with contextlib.ExitStack() as held:
        for hold_part in holders:
            held.enter_context(hold_part(params))
        yield bool(holders)
