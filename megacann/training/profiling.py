"""Where a training step's time goes: a per-phase breakdown, and a torch.profiler trace of chosen steps.

``logging.profile_breakdown: true`` splits each step into data wait, forward, backward, pipeline transfer
waits, gradient communication and the optimizer step. Forward, backward and the transfer waits come from
the schedule's :class:`~megacann.pipeline.timeline.Timeline` (the one ``logging.timers`` uses); the
trainer's own phases are laps on a second Timeline of the same kind. Both synchronise the device at each
boundary, so queued kernels are booked to the phase that queued them; this slows training, hence off by
default. The phases are summed over the steps since the last logged one and printed as a table (with the
data-loader rule of thumb) and written to ``metrics.jsonl`` as ``breakdown``.

``logging.profiler: {start_step: A, end_step: B}`` records steps A..B with ``torch.profiler`` and writes
``<output_dir>/profiler/rank<R>.steps<A>-<B>.pt.trace.json`` (a Chrome trace, which TensorBoard's profiler
plugin also reads), plus on CUDA a memory snapshot ``memory_rank<R>.steps<A>-<B>.pickle`` (for
https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from megacann.config import MegacannConfig
from megacann.pipeline.timeline import Timeline
from megacann.training.runtime import Runtime

# The trainer's own phases, booked as laps: from the step's start to the micro-batches on the device,
# then the schedule (whose inside the schedule's timeline splits), the gradient reductions, the update.
STEP_PHASES = ("data_wait", "schedule", "grad_comm", "optimizer")
# What the breakdown reports, in step order; the parts add up to the step. "pipeline" is the schedule's
# time outside forward and backward: the bubble and the activation transfers between stages (nearly zero
# without pipelining). "step_sync" is the step's small collectives outside the schedule (the global
# token count before it, the loss reduction after the update), mostly waiting for the slowest rank.
PARTS = ("data_wait", "forward", "backward", "pipeline", "grad_comm", "optimizer", "step_sync")
LABELS = {
    "data_wait": "data wait",
    "forward": "forward",
    "backward": "backward",
    "pipeline": "pipeline bubble+p2p",
    "grad_comm": "grad communication",
    "optimizer": "optimizer step",
    "step_sync": "step sync",
}
DATA_WAIT_LIMIT = 0.10  # rule of thumb: data wait above this share of the step means the loader is the bottleneck

Print = Callable[[str], None]


class StepBreakdown:
    """Sums each step's phases over a window of steps (the log interval) and reports per-step means."""

    def __init__(self, synchronize: Optional[Callable[[], None]], schedule_timeline: Timeline, grad_buffers=None):
        self.phases = Timeline(synchronize, kinds=STEP_PHASES)
        self.schedule = schedule_timeline
        self.grad_buffers = grad_buffers
        self._reset_window()

        self._in_step = False

    def _reset_window(self) -> None:
        self.sums = dict.fromkeys((*PARTS, "step"), 0.0)
        self.steps: list[int] = []

    def begin(self) -> None:
        """At the start of a step (before the step clock starts)."""
        self.phases.reset()
        self.phases.mark()
        self._in_step = True

    def lap(self, phase: str) -> None:
        """Book the phase that ends now; a step run outside :meth:`begin` / :meth:`end` is not measured."""
        if self._in_step:
            self.phases.lap(phase)

    def end(self, step: int, step_time: float) -> None:
        """After the step: add its phases (the schedule timeline still holds this step) to the window."""
        self._in_step = False
        phases, schedule = self.phases.totals, self.schedule.totals
        after_laps = step_time - sum(phases.values())  # from the update's end to the step's: the loss reduction
        wall = self.schedule.wall
        measured = {
            "data_wait": phases["data_wait"],
            "forward": schedule["forward"],
            "backward": schedule["backward"],
            "pipeline": wall - schedule["forward"] - schedule["backward"],
            "grad_comm": phases["grad_comm"],
            "optimizer": phases["optimizer"],
            "step_sync": phases["schedule"] - wall + after_laps,
            "step": step_time,
        }
        for key, value in measured.items():
            self.sums[key] += value
        self.steps.append(step)

    def window(self) -> Optional[dict[str, Any]]:
        """Per-step means of the window in seconds (``<part>_s``, ``step_s``), the steps it covers, the
        data-wait share; then a fresh window starts. None when no step was measured."""
        if not self.steps:
            return None
        n = len(self.steps)
        means = {key: value / n for key, value in self.sums.items()}
        result: dict[str, Any] = {f"{p}_s": means[p] for p in PARTS}
        result.update(
            step_s=means["step"],
            first_step=self.steps[0],
            last_step=self.steps[-1],
            data_wait_fraction=means["data_wait"] / means["step"] if means["step"] > 0 else 0.0,
        )
        result.update(self._overlap())
        self._reset_window()
        return result

    def _overlap(self) -> dict[str, int]:
        """With distributed.overlap_grad_reduce: how many gradient buckets the last step reduced, and how many
        of them started during backward."""
        if self.grad_buffers is None or not self.grad_buffers.overlap:
            return {}
        buffers = self.grad_buffers.buffers
        return {
            "grad_buckets": sum(len(b.buckets) for b in buffers),
            "grad_buckets_overlapped": sum(b.overlapped_buckets for b in buffers),
        }


def format_breakdown(window: dict[str, Any]) -> str:
    """The console table of one window, with the data-loader rule of thumb."""
    step = window["step_s"]
    first, last = window["first_step"], window["last_step"]
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    lines = [f"time per step, {steps} (mean; device-synchronised timers):"]
    for part in PARTS:
        seconds = window[f"{part}_s"]
        share = 100.0 * seconds / step if step > 0 else 0.0
        lines.append(f"  {LABELS[part]:<20}{seconds * 1e3:10.2f} ms {share:6.1f}%")
    lines.append(f"  {'step':<20}{step * 1e3:10.2f} ms  100.0%")
    if "grad_buckets" in window:
        lines.append(
            f"  gradient buckets started during backward: {window['grad_buckets_overlapped']} of "
            f"{window['grad_buckets']} (their hidden time is in backward, what was left in grad communication)"
        )
    share = window["data_wait_fraction"]
    verdict = (
        f"{100 * share:.1f}% here: the data loader is the bottleneck (more data.num_workers, faster storage, "
        "or data prepared ahead)"
        if share > DATA_WAIT_LIMIT
        else f"{100 * share:.1f}% here: the loader keeps up"
    )
    lines.append(
        f"  rule of thumb: data wait above {100 * DATA_WAIT_LIMIT:.0f}% of the step means the data loader "
        f"is the bottleneck; {verdict}"
    )
    return "\n".join(lines)


class TraceWindow:
    """A torch.profiler recording of steps start_step..end_step of this rank (and a CUDA memory snapshot)."""

    def __init__(self, window: dict, output_dir: str, rank: int, device_type: str, log: Print):
        self.start_step, self.end_step = window["start_step"], window["end_step"]
        self.directory = os.path.join(output_dir, "profiler")
        self.rank, self.device_type, self.log = rank, device_type, log
        self.name = f"rank{rank}.steps{self.start_step}-{self.end_step}"
        self._profiler = None
        self._step_range = None
        self._memory = False
        self._finished = False

    @property
    def trace_path(self) -> str:
        return os.path.join(self.directory, f"{self.name}.pt.trace.json")

    @property
    def memory_path(self) -> str:
        return os.path.join(self.directory, f"memory_{self.name}.pickle")

    def before_step(self, step: int) -> None:
        if self._finished or self._profiler is not None:
            self._enter_step(step)
            return
        if step > self.end_step:
            self._finished = True
            self.log(
                f"logging.profiler: steps {self.start_step}-{self.end_step} lie before this run's first step "
                f"{step} (resumed): no trace"
            )
            return
        if step < self.start_step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._memory = _start_memory_history()
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self._profiler.__enter__()
        self._enter_step(step)

    def _enter_step(self, step: int) -> None:
        if self._profiler is not None:
            self._step_range = torch.profiler.record_function(f"megacann step {step}")
            self._step_range.__enter__()

    def after_step(self, step: int) -> None:
        if self._profiler is None:
            return
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if step >= self.end_step:
            self.finish()

    def finish(self) -> None:
        """Stop recording and write the files (also called when training ends inside the window)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        profiler.__exit__(None, None, None)
        self._finished = True
        os.makedirs(self.directory, exist_ok=True)
        profiler.export_chrome_trace(self.trace_path)
        written = [self.trace_path]
        if self._memory:
            torch.cuda.memory._dump_snapshot(self.memory_path)
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(self.memory_path)
        self.log(f"logging.profiler: wrote {' and '.join(written)}")


def _start_memory_history() -> bool:
    """Start recording CUDA allocations for a memory snapshot; False where this torch cannot."""
    record = getattr(getattr(torch.cuda, "memory", None), "_record_memory_history", None)
    if record is None or not torch.cuda.is_available():
        return False
    record(max_entries=100_000)
    return True


class StepProfiling:
    """The trainer's one handle on both tools; every method does nothing for a tool the recipe leaves off.

    The trainer calls :meth:`before_step` / :meth:`after_step` around each step, :meth:`lap` after each
    of its phases, :meth:`log_window` when it logs a step and :meth:`close` at the end of training."""

    def __init__(
        self,
        cfg: MegacannConfig,
        runtime: Runtime,
        schedule_timeline: Optional[Timeline],
        log: Print,
        grad_buffers=None,
    ):
        """``schedule_timeline``: the Timeline the trainer passes to its schedule (needed for the breakdown);
        ``grad_buffers``: the optimizer's, to report how many reductions overlapped backward."""
        accelerator = runtime.accelerator
        self.breakdown: Optional[StepBreakdown] = None
        if cfg.logging.profile_breakdown:
            if schedule_timeline is None:
                raise ValueError("logging.profile_breakdown needs the schedule's timeline (pass the trainer's)")
            self.breakdown = StepBreakdown(accelerator.synchronize, schedule_timeline, grad_buffers)
        self.trace: Optional[TraceWindow] = None
        if cfg.logging.profiler is not None:
            self.trace = TraceWindow(
                cfg.logging.profiler, cfg.experiment.output_dir, runtime.rank, accelerator.device_type, log
            )

    def before_step(self, step: int) -> None:
        """Before step ``step`` (1-based) starts."""
        if self.trace is not None:
            self.trace.before_step(step)
        if self.breakdown is not None:
            self.breakdown.begin()

    def lap(self, phase: str) -> None:
        """The step's ``phase`` (one of STEP_PHASES) ends now."""
        if self.breakdown is not None:
            self.breakdown.lap(phase)

    def after_step(self, step: int, step_time: float) -> None:
        if self.breakdown is not None:
            self.breakdown.end(step, step_time)
        if self.trace is not None:
            self.trace.after_step(step)

    def log_window(self, record: dict[str, Any], log: Print) -> None:
        """Add the window's breakdown to a metrics record (``breakdown``) and print its table."""
        window = self.breakdown.window() if self.breakdown is not None else None
        if window is not None:
            record["breakdown"] = window
            log(format_breakdown(window))

    def close(self) -> None:
        if self.trace is not None:
            self.trace.finish()
