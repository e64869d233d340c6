"""Training metrics: a console line and one JSON object per logged step, plus optional wandb/tensorboard."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Optional, TextIO

from megacann.config import MegacannConfig

GRAD_NORM_WARNING = 10.0


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def format_step_line(record: dict[str, Any], max_steps: int, eta_seconds: Optional[float]) -> str:
    step = record["step"]
    parts = [f"step {step}/{max_steps} ({100.0 * step / max_steps:.0f}%)", f"loss {record['loss']:.4f}"]
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
        parts.append(f"eta {format_duration(eta_seconds)}")
    return " | ".join(parts)


class MetricsLogger:
    """Writes ``<output_dir>/metrics.jsonl`` and console lines (on the logging rank only)."""

    def __init__(self, cfg: MegacannConfig, enabled: bool, stream: TextIO = sys.stdout):
        self.enabled = enabled
        self.stream = stream
        self.max_steps = cfg.optim.max_steps
        self.path = os.path.join(cfg.experiment.output_dir, "metrics.jsonl")
        self.start_time = time.monotonic()
        self.start_step: Optional[int] = None
        self._wandb = self._tensorboard = None
        if enabled:
            os.makedirs(cfg.experiment.output_dir, exist_ok=True)
            self._wandb = _maybe_wandb(cfg)
            self._tensorboard = _maybe_tensorboard(cfg)

    def print(self, message: str) -> None:
        if self.enabled:
            print(message, file=self.stream, flush=True)

    def warn(self, message: str) -> None:
        self.print(f"WARNING: {message}")

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = record["step"]
        if self.start_step is None:
            self.start_step, self.start_time = step - 1, time.monotonic() - record.get("step_time", 0.0)
        done = step - self.start_step
        eta = (time.monotonic() - self.start_time) / done * (self.max_steps - step) if done > 0 else None
        if "loss" in record:
            self.print(format_step_line(record, self.max_steps, eta))
            norm = record.get("grad_norm")
            if norm is not None and not math.isfinite(norm):
                self.warn(f"grad_norm is {norm} at step {step}")
            elif norm is not None and norm > GRAD_NORM_WARNING:
                self.warn(f"grad_norm {norm:.2f} exceeds {GRAD_NORM_WARNING:g} at step {step}")
        else:
            self.print(" | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        if self._tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _maybe_wandb(cfg: MegacannConfig):
    if not cfg.logging.wandb:
        return None
    try:
        import wandb
    except Exception as err:
        raise RuntimeError("logging.wandb is true but wandb is not importable: pip install 'megacann[wandb]'") from err
    return wandb.init(project=cfg.logging.wandb_project or "megacann", name=cfg.experiment.name, config=cfg.to_dict())


def _maybe_tensorboard(cfg: MegacannConfig):
    if not cfg.logging.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception as err:
        raise RuntimeError(
            "logging.tensorboard is true but tensorboard is not importable: pip install 'megacann[tensorboard]'"
        ) from err
    return SummaryWriter(os.path.join(cfg.experiment.output_dir, "tensorboard"))
