"""Per-stage timing of a schedule: forward, backward (or its input-gradient half, B), the weight-gradient
half W of a split backward, and the waits for receives and sends.

A :class:`Timeline` is passed to a schedule (``timeline=``; the trainer does so when ``logging.timers`` is
true). The schedule marks its whole run with :meth:`Timeline.run` and every piece of work with
:meth:`Timeline.span`; what is neither forward nor backward is the stage's idle time, the pipeline bubble
plus communication (``weight`` counts the W half of a backward the zero-bubble schedules split, as
work). Spans are wall-clock; on an accelerator pass ``synchronize`` so queued kernels are counted where
they run (this serialises the device, so leave timers off for speed runs).

Work that follows one piece after another (the phases of a training step) is timed with laps instead of
spans: :meth:`Timeline.mark` starts the clock and each :meth:`Timeline.lap` books the time since the last
mark or lap to its kind. A timeline made with other ``kinds`` serves such phases
(:mod:`megacann.training.profiling`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Callable, Optional

KINDS = ("forward", "backward", "weight", "recv_wait", "send_wait")  # weight: the W of a split backward


class Timeline:
    def __init__(
        self,
        synchronize: Optional[Callable[[], None]] = None,
        keep_events: bool = False,
        kinds: tuple[str, ...] = KINDS,
    ):
        self.synchronize = synchronize
        self.keep_events = keep_events
        self.kinds = kinds
        self._lock = threading.Lock()  # spans may end on two threads (dualpipev's overlapped pairs)
        self.reset()

    def reset(self) -> None:
        """Forget everything measured so far."""
        self.totals = dict.fromkeys(self.kinds, 0.0)
        self.wall = 0.0
        self.events: list[tuple[str, float, float]] = []  # (kind, start, end), with keep_events
        self._mark: Optional[float] = None

    def _now(self) -> float:
        if self.synchronize is not None:
            self.synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Time one piece of work of ``kind`` (one of KINDS)."""
        if kind not in self.totals:
            raise ValueError(f"unknown timeline kind {kind!r}; expected one of {', '.join(self.kinds)}")
        start = self._now()
        try:
            yield
        finally:
            self._book(kind, start, self._now())

    def _book(self, kind: str, start: float, end: float) -> None:
        with self._lock:
            self.totals[kind] += end - start
            if self.keep_events:
                self.events.append((kind, start, end))

    def mark(self) -> None:
        """Start the lap clock: the next :meth:`lap` counts from here."""
        self._mark = self._now()

    def lap(self, kind: str) -> None:
        """Book the time since the last mark or lap to ``kind`` and restart the lap clock there."""
        if kind not in self.totals:
            raise ValueError(f"unknown timeline kind {kind!r}; expected one of {', '.join(self.kinds)}")
        if self._mark is None:
            raise RuntimeError("Timeline.lap before Timeline.mark: start the lap clock first")
        now = self._now()
        self._book(kind, self._mark, now)
        self._mark = now

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        """Time a whole schedule run (the denominator of the idle fraction)."""
        start = self._now()
        try:
            yield
        finally:
            self.wall += self._now() - start

    @staticmethod
    def span_of(timeline: Optional[Timeline], kind: str) -> AbstractContextManager:
        """``timeline.span(kind)``, or nothing when there is no timeline."""
        return timeline.span(kind) if timeline is not None else contextlib.nullcontext()

    @staticmethod
    def run_of(timeline: Optional[Timeline]) -> AbstractContextManager:
        return timeline.run() if timeline is not None else contextlib.nullcontext()

    @property
    def busy(self) -> float:
        return sum(self.totals.get(kind, 0.0) for kind in ("forward", "backward", "weight"))

    @property
    def idle_fraction(self) -> float:
        """Share of the run's wall time spent neither in forward nor in backward (B or W)."""
        return max(0.0, 1.0 - self.busy / self.wall) if self.wall > 0 else 0.0

    def summary(self) -> dict[str, float]:
        """Seconds per kind, the run's wall time and the idle fraction."""
        return {
            **{f"{k}_s": v for k, v in self.totals.items()},
            "wall_s": self.wall,
            "idle_fraction": self.idle_fraction,
        }
