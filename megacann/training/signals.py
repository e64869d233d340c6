"""SIGTERM and SIGINT end a run at a step boundary, every rank at the same step, after a checkpoint.

Schedulers send SIGTERM before preempting a job; Ctrl-C sends SIGINT to every process of the terminal
(torchrun forwards it once more). Either only sets a flag here: the step in flight finishes, then every
rank shares its flag (one small all-reduce on a CPU group per step, so no device synchronisation) and all
stop after the same step. The trainer then saves a checkpoint at that step (``training.save_on_signal``)
and raises :class:`RunInterrupted`, which ``megacann-train`` prints as one line, exiting with 128 + the
signal number as a shell does, so torchrun and schedulers see a run that did not finish. A further signal
more than ``FORCE_AFTER_S`` seconds after the first ends the process at once.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from megacann.errors import MegacannError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
FORCE_AFTER_S = 5.0  # a signal repeated this much later means "now" (torchrun's own repeat comes at once)


class RunInterrupted(MegacannError):
    """The run stopped on a signal, after saving what it was asked to save; exit code 128 + signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """Catches the stop signals while installed (:meth:`install` / :meth:`restore`, main thread only) and
    tells, collectively, whether any rank received one (:meth:`agreed`)."""

    def __init__(self, group: Optional[Any] = None):
        self.group = group  # a gloo group of every rank (None: one process)
        self.received: Optional[int] = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread; a trainer run elsewhere is not interruptible
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._first_at = signum, now
        elif now - self._first_at > FORCE_AFTER_S:
            print(f"megacann: {signal_name(signum)} again: exiting now, without a checkpoint", file=sys.stderr)
            os._exit(128 + signum)

    def agreed(self) -> Optional[int]:
        """The signal any rank received so far (the highest number if several), or None; every rank calls
        this after the same steps."""
        value = self.received or 0
        if self.group is not None:
            flag = torch.tensor([value], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            value = int(flag.item())
        return value or None


def make_stop_signals(timeout_minutes: float = 30.0) -> StopSignals:
    """A :class:`StopSignals` for this job (collective: every rank calls it, at the same point)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        timeout = datetime.timedelta(minutes=timeout_minutes)
        return StopSignals(dist.new_group(backend="gloo", timeout=timeout))
    return StopSignals()


def stop_after_signal(trainer, signum: int, saved: bool) -> None:
    """Every rank, after the same step: save a checkpoint there (``training.save_on_signal``; ``saved``: the
    step's own checkpoint was just written), then raise :class:`RunInterrupted` with the one line to print."""
    cfg, step, name = trainer.cfg, trainer.state.step, signal_name(signum)
    if cfg.training.save_on_signal and not saved:
        trainer.checkpointer.save(trainer.checkpoint_parts(), cfg, log=lambda _: None)
    if saved or cfg.training.save_on_signal:
        trainer.checkpointer.wait()  # an asynchronous save is published before the process ends
        path = os.path.join(cfg.experiment.output_dir, f"checkpoint_{step}")
        what = f"checkpoint {path} saved; continue with --resume_from latest"
    else:
        what = "no checkpoint saved (training.save_on_signal: false)"
    raise RunInterrupted(f"{name}: stopped after step {step} of {cfg.optim.max_steps}, {what}", signum)
