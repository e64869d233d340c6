"""When one rank fails, end every rank promptly and name the rank that failed.

Without help, the ranks waiting for a failed peer (a pipeline neighbour's activation, a collective) block
until the collective timeout, and what finally surfaces names none of the cause. Protocol, over the
rendezvous store (torchrun's, or the one at MASTER_ADDR:MASTER_PORT):

1. a rank whose guarded work (:func:`failure_guard`; the trainer guards every step) raises records
   ``rank R (pipeline stage S/P, tensor rank T/N, data rank D/M) failed: Type: message`` under one key; the
   first record wins;
2. on every rank a monitor thread polls that key; on seeing another rank's record it acknowledges it and,
   if the process is still alive after a grace period (half the collective timeout, at most 60 s),
   prints the record and exits, which on every backend also frees the peers that wait for it;
3. the failing rank waits (up to the grace period) until the others have acknowledged, so the store,
   which rank 0 may host, outlives their reading (not under torchrun, whose agent hosts the store), and
   then re-raises its own error;
4. a rank whose step fails afterwards (gloo reports a closed connection at once) raises
   :class:`PeerFailure` naming the recorded rank, with its own error as the cause.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.errors import TrainingAborted

FAILURE_KEY = "megacann/failure"
ACK_KEY = "megacann/failure_acks"


class PeerFailure(RuntimeError):
    """Raised on a rank that stops because another rank failed; the message names that rank."""


@dataclass(frozen=True)
class FailureRecord:
    rank: int
    where: str
    error: str

    def describe(self) -> str:
        return f"rank {self.rank} ({self.where}) failed: {self.error}"

    def encode(self) -> str:
        return json.dumps({"rank": self.rank, "where": self.where, "error": self.error})

    @staticmethod
    def decode(raw: bytes) -> FailureRecord:
        data = json.loads(raw.decode())
        return FailureRecord(int(data["rank"]), str(data["where"]), str(data["error"]))


def describe_rank() -> str:
    """This rank's place in the parallel grid, for messages."""
    return (
        f"pipeline stage {ps.get_pipeline_model_parallel_rank()}/{ps.get_pipeline_model_parallel_world_size()}, "
        f"tensor rank {ps.get_tensor_model_parallel_rank()}/{ps.get_tensor_model_parallel_world_size()}, "
        f"data rank {ps.get_data_parallel_rank()}/{ps.get_data_parallel_world_size()}"
    )


def store_client(timeout_s: float) -> Optional[dist.Store]:
    """A new client of the rendezvous store (one per thread), or None outside a torchrun-style launch.
    Keys live under this attempt's prefix: after a restart (torchrun --max-restarts) the store still holds
    the previous attempt's failure record, which must not end the new ranks."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    store = dist.TCPStore(
        addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return dist.PrefixStore(f"megacann/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


class FailureMonitor:
    """Records this rank's failure, watches for other ranks' failures (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, grace_s: float, store_factory: Callable[[], Optional[dist.Store]]):
        self.rank, self.world_size, self.grace_s = rank, world_size, grace_s
        self.poll_s = min(1.0, max(0.1, grace_s / 20))
        self._store_factory = store_factory
        self._main_store: Optional[dist.Store] = None  # the main thread's client, made on first use (a failure)
        self._seen: Optional[FailureRecord] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megacann-failure-monitor", daemon=True)

    def start(self) -> FailureMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the monitor thread and wait for it: a thread caught inside a store call when the interpreter
        exits is terminated by C++ (SIGABRT, "terminate called without an active exception")."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.grace_s + 10)  # a store call in flight returns within its timeout
        self._main_store = None  # close this client's connection now, before the store it talks to goes away

    @property
    def _store(self) -> dist.Store:
        """The main thread's client. Made only when a failure needs it: every connection a rank opens at start
        waits on the store's host, which may also be busy accepting every other rank's."""
        if self._main_store is None:
            self._main_store = self._store_factory()
        return self._main_store

    # -- main thread --------------------------------------------------------------------------------
    def known_failure(self) -> Optional[FailureRecord]:
        """The recorded failure, if any (None also when the store cannot be reached)."""
        if self._seen is not None:
            return self._seen
        with contextlib.suppress(Exception):
            if self._store.check([FAILURE_KEY]):
                return FailureRecord.decode(self._store.get(FAILURE_KEY))
        return None

    def report(self, error: BaseException) -> Optional[FailureRecord]:
        """Record ``error`` as this rank's failure unless another rank's came first; returns the record
        that holds (None when the store cannot be reached). The first reporter waits for the other
        ranks' acknowledgements, at most the grace period."""
        text = f"{type(error).__name__}: {error}".strip()
        mine = FailureRecord(self.rank, describe_rank(), text[:2000])
        try:
            held = FailureRecord.decode(self._store.compare_set(FAILURE_KEY, "", mine.encode()))
        except Exception:
            return None
        if held.rank != self.rank or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return held  # torchrun's agent hosts the store: it outlives this rank, no need to wait
        deadline = time.monotonic() + self.grace_s
        with contextlib.suppress(Exception):
            while self._store.add(ACK_KEY, 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(self.poll_s / 2)
        return held

    # -- monitor thread -----------------------------------------------------------------------------
    def _watch(self) -> None:
        if self._stop.is_set():  # stopped before this thread first ran (a short run on a busy CPU): the store
            return  # may be gone already, and connecting to it would outlast stop()'s wait
        try:
            store = self._store_factory()
            while not self._stop.wait(self.poll_s):
                if store.check([FAILURE_KEY]):
                    record = FailureRecord.decode(store.get(FAILURE_KEY))
                    if record.rank != self.rank:
                        self._seen = record
                        store.add(ACK_KEY, 1)
                        break
                    return
        except Exception:
            return  # the store went away: the job is ending anyway
        if self._stop.wait(self.grace_s) or self._seen is None:
            return
        print(
            f"megacann: ending rank {self.rank}: {self._seen.describe()} (still running {self.grace_s:.0f} s later)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)


_MONITOR: Optional[FailureMonitor] = None
_AT_EXIT: list[bool] = []


def start_failure_monitor(rank: int, world_size: int, timeout_minutes: float) -> Optional[FailureMonitor]:
    """Start this process's monitor (once; later calls return the running one). None for one rank or
    without a rendezvous store."""
    global _MONITOR
    if _MONITOR is not None or world_size < 2:
        return _MONITOR
    grace = min(60.0, 30.0 * timeout_minutes)  # half the collective timeout, in seconds
    if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
        return None  # no rendezvous store to meet at (store_client would give None)
    factory = functools.partial(store_client, max(5.0, grace))
    _MONITOR = FailureMonitor(rank, world_size, grace, factory).start()
    if not _AT_EXIT:  # also for loops that never call shutdown_runtime()
        atexit.register(stop_failure_monitor)
        _AT_EXIT.append(True)
    return _MONITOR


def stop_failure_monitor() -> None:
    """Stop and join the monitor thread (safe to call more than once)."""
    global _MONITOR
    if _MONITOR is not None:
        monitor, _MONITOR = _MONITOR, None
        monitor.stop()


@contextlib.contextmanager
def failure_guard() -> Iterator[None]:
    """Turn an error in the block into a failure record (the first rank) or a PeerFailure naming it."""
    monitor = _MONITOR
    if monitor is None:
        yield
        return
    try:
        yield
    except (PeerFailure, TrainingAborted):  # a stop every rank decided alike is no rank's failure
        raise
    except Exception as err:
        held = monitor.known_failure()
        if held is None or held.rank == monitor.rank:
            held = monitor.report(err)
        if held is not None and held.rank != monitor.rank:
            raise PeerFailure(f"rank {monitor.rank} ({describe_rank()}) stops: {held.describe()}") from err
        raise


def guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run ``method`` inside :func:`failure_guard`."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with failure_guard():
            return method(*args, **kwargs)

    return wrapper
