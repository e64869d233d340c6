"""Training metrics: a console line and one JSON object per logged step, plus optional wandb / TensorBoard."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Optional, TextIO

from megacann.config import MegacannConfig
from megacann.data.progress import format_seconds

GRAD_NORM_WARNING = 10.0


def format_step_line(record: dict[str, Any], max_steps: int, eta_seconds: Optional[float]) -> str:
    step = record["step"]
    parts = [f"step {step}/{max_steps} ({100.0 * step / max_steps:.0f}%)", f"loss {record['loss']:.4f}"]
    if record.get("mtp_loss") is not None:  # multi-token prediction's scaled loss, added to the objective
        parts.append(f"mtp_loss {record['mtp_loss']:.4f}")
    if record.get("reward_margin") is not None:  # preference optimisation (train_mode dpo)
        parts.append(f"margin {record['reward_margin']:.3f} acc {record['reward_accuracy']:.2f}")
    if record.get("reward_mean") is not None:  # reinforcement learning (train_mode grpo)
        parts.append(f"reward {record['reward_mean']:.3f} len {record['response_length_mean']:.1f}")
    if record.get("grad_norm") is not None:
        parts.append(f"grad_norm {record['grad_norm']:.3f}")
    parts.append(f"lr {record['lr']:.3e}")
    parts.append(f"{record['tokens_per_second']:,.0f} tok/s")
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    mem = record.get("mem_allocated_peak_gib", record.get("rss_peak_gib"))
    if mem is not None:
        parts.append(f"mem {mem:.2f} GiB")
    parts.append(f"{record['step_time']:.2f} s/step")
    if record.get("loss_scale") is not None:
        parts.append(f"scale {record['loss_scale']:.0f}")
    if eta_seconds is not None:
        parts.append(f"eta {format_seconds(eta_seconds)}")
    return " | ".join(parts)


class EtaEstimate:
    """Time left to max_steps from the recent pace: the last ``WINDOW`` intervals between logged steps.
    The start of a run is slow (first allocations, caches, data workers filling their queues), so neither
    the steps up to the first logged line nor the interval after it count: the first two lines show no
    ETA rather than one extrapolated from the warm-up. A recent window follows a run whose pace changes."""

    WINDOW = 5

    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self.marks: list[tuple[int, float]] = []  # (logged step, time), the first one dropped once used

    def update(self, step: int, now: Optional[float] = None) -> Optional[float]:
        now = time.monotonic() if now is None else now
        self.marks.append((step, now))
        if len(self.marks) < 3:
            return None
        window = self.marks[1:][-(self.WINDOW + 1) :]
        (first_step, first_time), (last_step, last_time) = window[0], window[-1]
        if last_step <= first_step:
            return None
        return (last_time - first_time) / (last_step - first_step) * max(0, self.max_steps - step)


def flatten_scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics record under flat names (``stage_timers/forward_s/1``), ``step`` left out:
    what wandb and TensorBoard receive, so they show the same metrics as metrics.jsonl."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if not prefix and key == "step":
            continue
        if isinstance(value, (bool, int, float)):
            flat[name] = float(value) if isinstance(value, bool) else value
        elif isinstance(value, dict):
            flat.update(flatten_scalars(value, name + "/"))
        elif isinstance(value, (list, tuple)):
            flat.update(flatten_scalars({str(i): v for i, v in enumerate(value)}, name + "/"))
    return flat


def _aside_name(path: str) -> str:
    """A free name for an earlier run's metrics file: ``metrics.<its last write time>.jsonl``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(path)))
    base, ext = os.path.splitext(path)
    candidate, n = f"{base}.{stamp}{ext}", 1
    while os.path.exists(candidate):
        candidate, n = f"{base}.{stamp}-{n}{ext}", n + 1
    return candidate


class MetricsLogger:
    """Writes ``<output_dir>/metrics.jsonl``, console lines and (optionally) wandb / TensorBoard, on the
    logging rank only. :meth:`start` is called once the starting step is known (after a resume)."""

    def __init__(self, cfg: MegacannConfig, enabled: bool, stream: Optional[TextIO] = None):
        self.enabled = enabled
        self.stream = stream  # None: sys.stdout as it is when a line is printed
        self.max_steps = cfg.optim.max_steps
        self.path = os.path.join(cfg.experiment.output_dir, "metrics.jsonl")
        self.eta = EtaEstimate(self.max_steps)
        self._wandb = self._tensorboard = None
        if enabled:
            os.makedirs(cfg.experiment.output_dir, exist_ok=True)
            self._wandb = _maybe_wandb(cfg)
            self._tensorboard = _maybe_tensorboard(cfg)

    def print(self, message: str) -> None:
        if self.enabled:
            print(message, file=self.stream or sys.stdout, flush=True)

    def warn(self, message: str) -> None:
        self.print(f"WARNING: {message}")

    def start(self, step: int) -> None:
        """Make metrics.jsonl this run's: a fresh start (``step`` 0) moves an earlier run's file aside; a
        resume from step ``step`` drops the records an earlier run logged past that step (they are redone)."""
        if not self.enabled or not os.path.isfile(self.path) or os.path.getsize(self.path) == 0:
            return
        if step == 0:
            aside = _aside_name(self.path)
            os.replace(self.path, aside)
            self.print(f"metrics.jsonl of an earlier run in this output_dir moved aside to {aside}")
            return
        with open(self.path) as f:
            lines = [line for line in f if line.strip()]
        kept = [line for line in lines if _record_step(line) <= step]
        if len(kept) == len(lines):
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)
        self.print(
            f"metrics.jsonl: dropped {len(lines) - len(kept)} records logged after step {step}, the step resumed from"
        )

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = record["step"]
        if "loss" in record:
            self.print(format_step_line(record, self.max_steps, self.eta.update(step)))
            norm = record.get("grad_norm")
            if norm is not None and not math.isfinite(norm):
                self.warn(f"grad_norm is {norm} at step {step}")
            elif norm is not None and norm > GRAD_NORM_WARNING:
                self.warn(f"grad_norm {norm:.2f} exceeds {GRAD_NORM_WARNING:g} at step {step}")
        else:
            self.print(" | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = flatten_scalars(record) if self._wandb is not None or self._tensorboard is not None else {}
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def _record_step(line: str) -> float:
    """The step of one metrics.jsonl line (a line that is not a record sorts last: a torn final write)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def _maybe_wandb(cfg: MegacannConfig):
    """A wandb run (project, run name, mode from the recipe; files under output_dir), or None."""
    lg = cfg.logging
    if not lg.wandb or lg.wandb_mode == "disabled":
        return None
    try:
        import wandb
    except Exception as err:
        raise RuntimeError("logging.wandb is true but wandb is not importable: pip install 'megacann[wandb]'") from err
    return wandb.init(
        project=lg.wandb_project or "megacann",
        name=lg.wandb_run_name or cfg.experiment.name,
        mode=lg.wandb_mode,
        dir=cfg.experiment.output_dir,
        config=cfg.to_dict(),
        settings=wandb.Settings(console="off"),  # our own console lines stay as they are
    )


def _maybe_tensorboard(cfg: MegacannConfig):
    """A TensorBoard writer for ``<output_dir>/tensorboard``, or None."""
    if not cfg.logging.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception as err:
        raise RuntimeError(
            "logging.tensorboard is true but tensorboard is not importable: pip install 'megacann[tensorboard]'"
        ) from err
    return SummaryWriter(os.path.join(cfg.experiment.output_dir, "tensorboard"))
