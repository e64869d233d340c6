"""Tensor-parallel-aware random numbers and activation checkpointing.

Two streams, after :func:`model_parallel_manual_seed`:

- the *default* generator, seeded alike on every TP rank: used to initialise weights (the full tensor is
  drawn on every rank, then sliced) and for dropout on activations every TP rank holds whole (the hidden
  state without sequence parallelism), so the ranks drop the same elements and stay replicas;
- the ``model-parallel-rng`` stream of the tracker, different on every TP rank: used, inside
  ``get_rng_tracker().fork()``, for dropout on activations that are split across TP ranks (attention
  probabilities of each rank's heads, the sequence-parallel hidden state), so each shard gets its own mask.

The tracker forks the generator that dropout uses on the accelerator in use (the CPU generator on CPU,
``torch.cuda`` / ``torch.npu`` otherwise). :func:`checkpoint` recomputes a function in backward with the
RNG states (default generator and tracker) it saw in forward, so dropout masks match.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from megacann import parallel_state as ps
from megacann.accelerator import get_accelerator

MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron's offset, so the TP streams never coincide with the default seed


class _Generator:
    """get/set/seed of the generator dropout uses on the current accelerator."""

    def __init__(self) -> None:
        self.accelerator = get_accelerator()
        self.on_cpu = self.accelerator.device_type == "cpu"

    def get_state(self) -> torch.Tensor:
        return torch.get_rng_state() if self.on_cpu else self.accelerator.get_rng_state()

    def set_state(self, state: torch.Tensor) -> None:
        if self.on_cpu:
            torch.set_rng_state(state)
        else:
            self.accelerator.set_rng_state(state)

    def seed(self, seed: int) -> None:
        if self.on_cpu:
            torch.default_generator.manual_seed(seed)
        else:
            self.accelerator.manual_seed(seed)


class RNGStatesTracker:
    """Named RNG states that can be swapped in around a block of code (Megatron's CudaRNGStatesTracker,
    for any device)."""

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()
        self._generator: Optional[_Generator] = None

    @property
    def generator(self) -> _Generator:
        if self._generator is None:
            self._generator = _Generator()
        return self._generator

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()
        self._generator = None

    def is_initialized(self) -> bool:
        return bool(self._states)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` (names and seeds must be new)."""
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        gen = self.generator
        saved = gen.get_state()
        gen.seed(seed)
        self._states[name] = gen.get_state()
        gen.set_state(saved)
        self._seeds.add(seed)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (for checkpoints)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default generator is left as it was."""
        if name not in self._states:
            raise RuntimeError(
                f"RNG stream {name!r} does not exist; call megacann.layers.model_parallel_manual_seed(seed) first"
            )
        gen = self.generator
        saved = gen.get_state()
        gen.set_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = gen.get_state()
            gen.set_state(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default generators with ``seed`` (same on every TP rank) and create the tracker streams:
    ``model-parallel-rng`` = seed + 2718 + tp_rank, ``expert-parallel-rng`` = seed + 2718 + 100·(ep_rank + 1)
    + tp_rank."""
    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    torch.manual_seed(seed)
    get_accelerator().manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)
    _TRACKER.add(EXPERT_PARALLEL_RNG, seed + _TP_SEED_OFFSET + 100 * (ep_rank + 1) + tp_rank)


def dropout(x: torch.Tensor, p: float, training: bool, tensor_parallel: bool) -> torch.Tensor:
    """Dropout whose mask comes from the TP stream when ``x`` is split across TP ranks, else from the
    default generator (same mask on every TP rank)."""
    if p == 0.0 or not training:
        return x
    if tensor_parallel:
        with _TRACKER.fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


_RECOMPUTING = threading.local()  # .depth: recomputations running now in this thread


def is_recomputing() -> bool:
    """True while :func:`checkpoint` recomputes a forward pass in backward (layers that count or record
    something per forward, such as an MoE router's token counts, skip it then). Per thread: a backward's
    recompute on another thread (DualPipeV's overlapped pairs) leaves this thread's forward counting."""
    return getattr(_RECOMPUTING, "depth", 0) > 0


_RECOMPUTE_CONTEXTS = threading.local()  # .stack: context factories a recompute re-enters (this thread's)


@contextlib.contextmanager
def recomputed_inside(factory: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """A forward that :func:`checkpoint` runs inside the block is recomputed in backward, after the block
    has closed, inside ``factory()`` too: state the forward read beside its inputs (the recorded choices
    of router replay) holds for its recompute as well."""
    stack = _RECOMPUTE_CONTEXTS.__dict__.setdefault("stack", [])
    stack.append(factory)
    try:
        yield
    finally:
        stack.pop()


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in backward with
    the RNG states of the forward pass (CPU and device generators, and the tracker's streams), so dropout
    draws the same masks, and inside the contexts of :func:`recomputed_inside` open at the forward. Works
    when no input requires grad (parameters inside still get gradients)."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    start_states = _TRACKER.get_states()
    contexts = tuple(getattr(_RECOMPUTE_CONTEXTS, "stack", ()))
    calls = [0]

    def run(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:  # the forward pass
            return function(*a, **kw)
        live = _TRACKER.get_states()  # a recompute, during backward
        _TRACKER.set_states(start_states)
        _RECOMPUTING.depth = getattr(_RECOMPUTING, "depth", 0) + 1
        try:
            with contextlib.ExitStack() as opened:
                for factory in contexts:
                    opened.enter_context(factory())
                return function(*a, **kw)
        finally:
            _RECOMPUTING.depth -= 1
            _TRACKER.set_states(live)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
