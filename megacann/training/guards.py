"""Step guards: skip an update whose loss or gradient norm is not finite (or spikes), and stop a run that
keeps doing so.

Every rank decides from values that are already the same on every rank: the loss of the global batch
(reduced over data-parallel ranks and gathered over pipeline stages) and the global gradient norm (summed
over every rank that holds part of the model). So all ranks skip the same steps without an extra
collective. A skipped step leaves parameters and optimizer state untouched; the step counter, the learning
rate schedule and the data position move on (the batch is dropped). fp16 overflow steps stay the loss
scaler's business (it halves the scale and skips); they are counted as skipped but do not count towards
``training.max_skipped_steps``, whose purpose is to stop a run that has really diverged.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, Optional

from megacann.config.schema import TrainingConfig
from megacann.errors import TrainingAborted

Log = Callable[[str], None]


class StepGuard:
    """Per-step verdicts (:meth:`check_loss`, then :meth:`check_grad_norm` from inside the optimizer step)
    and the bookkeeping of skipped steps (:meth:`end_step`)."""

    def __init__(self, cfg: TrainingConfig, log: Log = print):
        self.max_skipped = cfg.max_skipped_steps
        self.spike_factor = cfg.loss_spike_factor
        self.skip_spikes = cfg.skip_loss_spikes
        self.recent: deque[float] = deque(maxlen=cfg.loss_spike_window)  # losses of applied steps
        self.log = log
        self.reason: Optional[str] = None  # why the current step is skipped (None: not by the guard)
        self.consecutive = 0  # guard skips in a row
        self.first_skipped: Optional[int] = None  # the first step of the current run of skips
        self.total = 0  # guard skips since this process started

    def running_mean(self) -> Optional[float]:
        """The mean loss of the last ``loss_spike_window`` applied steps, once that many were seen."""
        if len(self.recent) < (self.recent.maxlen or 1):
            return None
        return sum(self.recent) / len(self.recent)

    def check_loss(self, loss: float) -> Optional[str]:
        """The reason to skip this step's update because of its loss, or None. Warns on a spike."""
        self.reason = None
        if not math.isfinite(loss):
            self.reason = f"the loss is {loss}"
            return self.reason
        mean = self.running_mean()
        if self.spike_factor and mean is not None and loss > self.spike_factor * mean:
            what = (
                f"loss {loss:.4f} is {loss / mean:.1f} x its running mean {mean:.4f} "
                f"(training.loss_spike_factor {self.spike_factor})"
            )
            if self.skip_spikes:
                self.reason = what
                return self.reason
            self.log(f"warning: {what}; the step is applied (training.skip_loss_spikes: true skips such steps)")
        return None

    def check_grad_norm(self, grad_norm: float) -> bool:
        """True (skip) when the global gradient norm is not finite; given to the optimizer's step as its veto."""
        if math.isfinite(grad_norm):
            return False
        self.reason = f"the gradient norm is {grad_norm}"
        return True

    def end_step(self, step: int, loss: float, updated: bool, samples: tuple[int, int]) -> Optional[str]:
        """Count the step's outcome; returns the reason it was skipped by the guard (None otherwise). Raises
        :class:`TrainingAborted` after ``max_skipped_steps`` guard skips in a row. ``samples`` is the range
        of the global sample order the step used, for the messages."""
        reason = self.reason
        self.reason = None
        if reason is None:
            if updated:
                self.consecutive, self.first_skipped = 0, None
                self.recent.append(loss)
            return None
        self.consecutive += 1
        self.total += 1
        if self.first_skipped is None:
            self.first_skipped = step
        if self.consecutive >= self.max_skipped:
            raise TrainingAborted(
                f"step {step}: {self.consecutive} consecutive steps skipped (steps {self.first_skipped}-{step}, "
                f"training.max_skipped_steps {self.max_skipped}), the last because {reason}; stopping without "
                "saving a checkpoint (the newest one predates these steps). Try a lower optim.lr or "
                f"optim.clip_grad, look at the data of these steps (samples up to {samples[1]} of the global "
                "order), or resume from the newest checkpoint"
            )
        self.log(
            f"step {step}: update skipped because {reason} (samples {samples[0]}-{samples[1] - 1}); parameters "
            f"and optimizer state unchanged ({self.consecutive} in a row, {self.total} in all; the run stops "
            f"after {self.max_skipped} in a row)"
        )
        return reason
