"""A progress bar for long data jobs (preprocessing, the default corpus and its tokenizer, cache builds).

One line on stderr: on a terminal it is redrawn in place a few times a second; in a log file (not a
terminal) a new line is written every ``LOG_EVERY_S`` seconds, so logs stay short. With a known total it
shows a bar, the share done and the time left; without, only what was done and the rate.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

TTY_EVERY_S = 0.2
LOG_EVERY_S = 10.0
BAR_WIDTH = 24


def format_seconds(seconds: float) -> str:
    """``7s``, ``5m03s``, ``1h05m``: durations in progress bars and ETAs."""
    seconds = int(max(0, seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class ProgressBar:
    """``advance(amount, detail)`` as work gets done; ``close()`` ends the line and returns the seconds spent."""

    def __init__(
        self,
        label: str,
        total: Optional[float] = None,
        unit: str = "",
        enabled: bool = True,
        stream: Optional[TextIO] = None,
    ):
        self.label, self.total, self.unit, self.enabled = label, total, unit, enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0.0
        self.start = self.last = time.perf_counter()
        self.detail = ""
        self._drawn = False

    def render(self, now: Optional[float] = None) -> str:
        """The status line as it would be drawn now."""
        elapsed = (now if now is not None else time.perf_counter()) - self.start
        parts = [self.label]
        if self.total:
            share = min(1.0, self.done / self.total)
            filled = int(round(share * BAR_WIDTH))
            parts.append(f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {share:4.0%}")
            parts.append(f"{self.done:,.0f}/{self.total:,.0f} {self.unit}".rstrip())
            if 0 < share < 1 and elapsed > 0:
                parts.append(f"{format_seconds(elapsed / share - elapsed)} left")
        else:
            parts.append(f"{self.done:,.0f} {self.unit}".rstrip())
        if self.detail:
            parts.append(self.detail)
        parts.append(format_seconds(elapsed))
        return " | ".join(parts)

    def advance(self, amount: float = 1, detail: str = "") -> None:
        self.done += amount
        if detail:
            self.detail = detail
        now = time.perf_counter()
        if self.enabled and now - self.last >= (TTY_EVERY_S if self.tty else LOG_EVERY_S):
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        line = self.render(now)
        if self.tty:
            print("\r" + line, end="", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)
        self._drawn = True

    def close(self) -> float:
        """Draw the final state (on a terminal, or if anything was drawn) and return the elapsed seconds."""
        now = time.perf_counter()
        if self.enabled and (self.tty or self._drawn):
            self._draw(now)
            if self.tty:
                print(file=self.stream, flush=True)
        return now - self.start
