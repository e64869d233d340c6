"""ZeRO-3's units: the modules whose weights are gathered together before their forward and backward and
freed after them.

Every module of the classes the model family names (``ModelSpec.sharding_units``: megacann's families their
transformer blocks, a family of its own blocks those) is a unit; each model chunk is a unit too, holding the
weights outside them (embedding, final norm, output layer). A family that names none has one unit per chunk,
so its chunk's weights are all whole while it runs. A unit's buckets are
gathered in its forward pre-hook and freed in its forward hook; a hook on its outputs gathers them again
when the gradient reaches them (before its backward, recomputation included) and a hook on its input
frees them once the gradient has passed through it. What is still gathered when the backward ends (a
chunk's own weights, a unit whose input needs no gradient) is freed then. With ``prefetch`` the next
unit's gather (in the order the first forward ran them; the previous one in backward) starts before the
current unit computes, overlapping the communication. :meth:`UnitHooks.holding_gathered` (registered for
each chunk with :func:`megacann.layers.gathered_weights.register_weight_holder`) gathers every unit once and
keeps them whole through the forwards inside it (generation), freeing them at its end;
:meth:`UnitHooks.holding_units_of` does so for the units of some parameters (streaming, one part at a time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields, is_dataclass

import torch
from torch.utils._pytree import tree_flatten

from megacann.layers.gathered_weights import register_weight_holder
from megacann.optimizer.zero.sharded_params import ShardedParams

UnitTypes = tuple[type[torch.nn.Module], ...]


@dataclass
class Unit:
    index: int
    module: torch.nn.Module
    root: int  # index of the chunk it belongs to
    pieces: list[tuple[ShardedParams, int]] = field(default_factory=list)  # (storage, bucket index)
    in_backward: bool = False


def unit_modules(
    roots: list[torch.nn.Module], unit_types: UnitTypes
) -> tuple[list[tuple[torch.nn.Module, int]], dict[int, int]]:
    """The units of ``roots`` (each chunk first, then its modules of ``unit_types``) and the unit index of
    every parameter, by id: a parameter belongs to the outermost such module holding it, else its chunk."""
    modules: list[tuple[torch.nn.Module, int]] = []
    unit_of: dict[int, int] = {}
    for root_index, root in enumerate(roots):
        root_unit = len(modules)
        modules.append((root, root_index))
        for module in root.modules():
            if unit_types and isinstance(module, unit_types) and module is not root:
                index = len(modules)
                modules.append((module, root_index))
                for p in module.parameters():
                    unit_of.setdefault(id(p), index)
        for p in root.parameters():
            unit_of.setdefault(id(p), root_unit)
    return modules, unit_of


def _grad_tensors(value) -> list[torch.Tensor]:
    """The tensors needing a gradient in a module's inputs or outputs, inside dataclasses too (a model
    chunk's ``ChunkOutput``, which pytree flattening would take for one opaque leaf)."""
    if is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in fields(value)]
    found = []
    for leaf in tree_flatten(value)[0]:
        if is_dataclass(leaf) and not isinstance(leaf, type):
            found += _grad_tensors(leaf)
        elif isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            found.append(leaf)
    return found


class UnitHooks:
    """Gathers and frees the units of ``roots`` around their forward and backward (see the module doc)."""

    def __init__(
        self, roots: list[torch.nn.Module], storages: Iterable[ShardedParams], prefetch: bool, unit_types: UnitTypes
    ):
        modules, self.unit_of = unit_modules(roots, unit_types)
        self.units = [Unit(i, module, root) for i, (module, root) in enumerate(modules)]
        for storage in storages:
            for bucket in storage.layout.buckets:
                self.units[self.unit_of[id(bucket.params[0])]].pieces.append((storage, bucket.index))
        self.prefetch = prefetch
        self.order: dict[int, list[int]] = {}  # root -> unit indices in the order the forward ran them
        self._callback_queued = False
        self.held = False  # inside holding_gathered: the forward hooks neither gather nor free
        self._handles = []
        for root in roots:
            register_weight_holder(root, self.holding_gathered, self.holding_units_of)
        for unit in self.units:
            module = unit.module
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(unit)))
            self._handles.append(module.register_forward_hook(self._post_forward(unit)))

    # -- gather / free --------------------------------------------------------------------------------
    @staticmethod
    def start(unit: Unit) -> None:
        for storage, index in unit.pieces:
            storage.gather_bucket(index)

    def gather(self, unit: Unit) -> None:
        self.start(unit)
        for storage, index in unit.pieces:
            storage.wait_bucket(index)

    @staticmethod
    def free(unit: Unit) -> None:
        unit.in_backward = False
        for storage, index in unit.pieces:
            storage.free_bucket(index)

    def _neighbour(self, unit: Unit, step: int) -> None:
        """Start gathering the unit ``step`` places from ``unit`` in forward order (prefetch)."""
        order = self.order.get(unit.root, [])
        if not self.prefetch or unit.index not in order:
            return
        position = order.index(unit.index) + step
        if 0 <= position < len(order):
            self.start(self.units[order[position]])

    @contextlib.contextmanager
    def holding_gathered(self) -> Iterator[None]:
        """Every unit whole inside the block (gathered once at its start), freed at its end: many forwards
        without a backward in between (generation) gather nothing more."""
        if self.held:  # nested: the outer block holds them
            yield
            return
        for unit in self.units:
            self.start(unit)
        for unit in self.units:
            self.gather(unit)
        self.held = True
        try:
            yield
        finally:
            self.held = False
            for unit in self.units:
                self.free(unit)

    @contextlib.contextmanager
    def holding_units_of(self, params: Iterable[torch.Tensor]) -> Iterator[None]:
        """The units holding ``params`` (those of these roots) whole inside the block; those it gathered are
        freed at its end: a walk over the weights one part at a time (streaming) holds one part gathered."""
        if self.held:  # inside holding_gathered: everything is whole already
            yield
            return
        wanted = sorted({self.unit_of[id(p)] for p in params if id(p) in self.unit_of})
        units = [self.units[index] for index in wanted]
        gathered_here = [unit for unit in units if all(s.is_free(index) for s, index in unit.pieces)]
        for unit in units:
            self.start(unit)
        try:
            for unit in units:
                self.gather(unit)
            yield
        finally:
            for unit in gathered_here:
                self.free(unit)

    # -- hooks ----------------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit):
        def hook(module: torch.nn.Module, args) -> None:
            if self.held:
                return
            order = self.order.setdefault(unit.root, [])
            if unit.index not in order:
                order.append(unit.index)
            self.gather(unit)
            self._neighbour(unit, +1)
            if torch.is_grad_enabled():
                for t in _grad_tensors(args):  # the gradient reaching the input: this unit's backward is done
                    t.register_hook(self._after_backward(unit))

        return hook

    def _post_forward(self, unit: Unit):
        def hook(module: torch.nn.Module, args, output) -> None:
            if self.held:
                return
            if not unit.in_backward:
                self.free(unit)
            if torch.is_grad_enabled():
                for t in _grad_tensors(output):
                    t.register_hook(self._before_backward(unit))

        return hook

    def _before_backward(self, unit: Unit):
        def hook(grad: torch.Tensor) -> None:
            unit.in_backward = True
            self.gather(unit)
            self._neighbour(unit, -1)
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

        return hook

    def _after_backward(self, unit: Unit):
        def hook(grad: torch.Tensor) -> None:
            if unit.in_backward:
                self.free(unit)

        return hook

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        for unit in self.units:  # prefetched units that did not run are freed too
            self.free(unit)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
