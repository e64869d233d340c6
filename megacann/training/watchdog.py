"""The hang watchdog: a step that runs far longer than usual is reported, with every rank's stack, and
ended before the collective timeout would end it with a message that names nothing.

A thread on every rank watches the operation the trainer is in (a training step, an evaluation, a
checkpoint save). A training step may run ``training.hang_factor`` times the median of the recent steps
(at least ``training.hang_min_seconds``); anything else, and the first steps before a median exists, up
to 90 % of the collective timeout. Past its limit the thread, on each rank where it fires:

1. says where this rank's main thread is: waiting in a collective (which one, called from where in
   megacann) or computing (at which line), and writes that with a Python stack dump of every thread
   (``faulthandler``) to stderr and to ``<output_dir>/hang_reports/rank<R>.txt``;
2. posts that line to the rendezvous store and collects the other ranks' lines for a few seconds, then
   names the suspects: ranks that are not waiting in a collective, or that never answered;
3. exits with :data:`HANG_EXIT_CODE`, naming itself, so torchrun (``--max-restarts``) or the scheduler
   can restart the job from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from typing import Optional

from megacann.training.failure import describe_rank, store_client

HANG_EXIT_CODE = 3
HANG_KEY = "megacann/hang/"
MIN_STEPS_FOR_MEDIAN = 3
EXCHANGE_S = 5.0  # how long a firing rank waits for the others' lines
_COMM_FILES = ("megacann/pipeline/p2p.py", "megacann/collectives.py")


def where_is(frame) -> tuple[bool, str]:
    """(waiting in communication?, description) of a thread whose innermost frame is ``frame``."""
    stack = traceback.extract_stack(frame)  # outermost first
    ours = [f for f in stack if f"{os.sep}megacann{os.sep}" in f.filename]
    origin = ""
    if ours:
        f = ours[-1]
        short = f.filename[f.filename.rfind(f"{os.sep}megacann{os.sep}") + 1 :]
        origin = f"{short}:{f.lineno} ({f.name})"
    collectives = [f for f in stack if f"torch{os.sep}distributed{os.sep}" in f.filename and not f.name.startswith("_")]
    collectives = [f for f in collectives if f.name not in ("wrapper", "inner")]
    if collectives:
        return True, f"waiting in torch.distributed {collectives[-1].name}, called from {origin or '?'}"
    if ours and any(ours[-1].filename.endswith(name) for name in _COMM_FILES):
        return True, f"waiting for a peer in {origin}"
    inner = stack[-1] if stack else None
    at = f"{inner.filename}:{inner.lineno} ({inner.name})" if inner else "?"
    return False, f"not in a collective: running {at}" + (f", from {origin}" if origin and inner not in ours else "")


class Watchdog:
    """See the module docstring. :meth:`watch` arms it around one operation; :meth:`stop` ends the thread."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        factor: float,
        min_seconds: float,
        timeout_s: float,
        report_dir: Optional[str],
        poll_s: float = 0.5,
    ):
        self.rank, self.world_size = rank, world_size
        self.factor, self.min_seconds = factor, min_seconds
        self.cap_s = 0.9 * timeout_s
        self.report_dir = report_dir
        self.poll_s = poll_s
        self.durations: deque[float] = deque(maxlen=50)
        self._armed: Optional[tuple[str, float, float]] = None  # (what, started, limit)
        self._main_ident = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megacann-watchdog", daemon=True)
        self._thread.start()

    # -- main thread --------------------------------------------------------------------------------
    def step_limit(self) -> float:
        if len(self.durations) < MIN_STEPS_FOR_MEDIAN:
            return self.cap_s
        return min(self.cap_s, max(self.min_seconds, self.factor * statistics.median(self.durations)))

    @contextlib.contextmanager
    def watch(self, what: str, is_step: bool = False) -> Iterator[None]:
        """Arm the watchdog around ``what`` (a training step's duration also feeds the median)."""
        start = time.monotonic()
        self._armed = (what, start, self.step_limit() if is_step else self.cap_s)
        try:
            yield
        finally:
            self._armed = None
        if is_step:
            self.durations.append(time.monotonic() - start)

    def stop(self) -> None:
        """End the thread and wait for it (it must not be inside a store call when the process exits)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    # -- watchdog thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            armed = self._armed
            if armed is not None and time.monotonic() - armed[1] > armed[2]:
                self._fire(*armed)

    def _fire(self, what: str, started: float, limit: float) -> None:
        elapsed = time.monotonic() - started
        frame = sys._current_frames().get(self._main_ident)
        waiting, where = where_is(frame) if frame is not None else (False, "main thread not found")
        median = f"median step {statistics.median(self.durations):.2f} s" if self.durations else "no median yet"
        line = (
            f"rank {self.rank} ({describe_rank()}): {what} has run {elapsed:.0f} s, over its limit of {limit:.0f} s "
            f"({median}, training.hang_factor {self.factor}, collective timeout {self.cap_s / 0.9:.0f} s): {where}"
        )
        path = self._write_report(line)
        print(f"megacann watchdog: {line}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        summary = self._exchange(line, waiting)
        if summary:
            print(f"megacann watchdog: {summary}", file=sys.stderr, flush=True)
            if path:
                with contextlib.suppress(OSError), open(path, "a") as f:
                    f.write(f"\n{summary}\n")
        saved = f"; report in {path}" if path else ""
        print(
            f"megacann watchdog: rank {self.rank} exits with code {HANG_EXIT_CODE} (hang in {what}){saved}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(HANG_EXIT_CODE)

    def _write_report(self, line: str) -> Optional[str]:
        if not self.report_dir:
            return None
        try:
            os.makedirs(self.report_dir, exist_ok=True)
            path = os.path.join(self.report_dir, f"rank{self.rank}.txt")
            with open(path, "w") as f:
                f.write(line + "\n\nPython stacks of every thread:\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            return path
        except OSError:
            return None

    def _exchange(self, line: str, waiting: bool) -> str:
        """Post this rank's line, read the others' (for a few seconds); the suspects, as one line."""
        if self.world_size < 2:
            return ""
        try:
            store = store_client(EXCHANGE_S)
            if store is None:
                return ""
            store.set(f"{HANG_KEY}{self.rank}", json.dumps({"waiting": waiting, "line": line}))
            keys = [f"{HANG_KEY}{r}" for r in range(self.world_size)]
            deadline = time.monotonic() + EXCHANGE_S
            while not store.check(keys) and time.monotonic() < deadline:
                time.sleep(0.2)
            reports = {r: json.loads(store.get(k)) for r, k in enumerate(keys) if store.check([k])}
            read = store.add(f"{HANG_KEY}read", 1)
            # outside torchrun rank 0 hosts the store: it leaves once every rank that reported has read
            while self.rank == 0 and read < len(reports) and time.monotonic() < deadline + EXCHANGE_S:
                time.sleep(0.1)
                read = store.add(f"{HANG_KEY}read", 0)
        except Exception:
            return ""
        silent = [r for r in range(self.world_size) if r not in reports]
        computing = [r for r, rep in reports.items() if not rep["waiting"]]
        waiting_ranks = [r for r, rep in reports.items() if rep["waiting"]]
        parts = []
        if computing:
            parts.append(f"rank(s) {computing} not in a collective (the others wait for them)")
        if silent:
            parts.append(f"rank(s) {silent} did not report (dead, or stuck without releasing Python's lock)")
        if not parts:
            parts.append("every rank waits in a collective (mismatched collectives? compare the stacks)")
        return f"suspects: {'; '.join(parts)}; waiting: {waiting_ranks}"


class _Unwatched:
    """The watchdog switched off (training.hang_factor: 0)."""

    @contextlib.contextmanager
    def watch(self, what: str, is_step: bool = False) -> Iterator[None]:
        yield

    def stop(self) -> None:
        pass


def start_watchdog(cfg, rank: int, world_size: int):
    """The recipe's watchdog for this rank (``training.hang_*``; limits below ``distributed.timeout_minutes``)."""
    t = cfg.training
    if not t.hang_factor:
        return _Unwatched()
    report_dir = os.path.join(cfg.experiment.output_dir, "hang_reports")
    timeout_s = 60.0 * cfg.distributed.timeout_minutes
    return Watchdog(rank, world_size, t.hang_factor, t.hang_min_seconds, timeout_s, report_dir)
