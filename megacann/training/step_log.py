"""What the trainer prints at the start of a run and records at each logged step.

The start lines say what runs where (layout, context-parallel share, the operators in use, a fine-tuning
run's base and trainable share); a step record holds the figures ``metrics.jsonl`` and the console show:
loss, grad norm, lr, throughput, MFU, the model's auxiliary losses and stats, memory, and with
``logging.timers`` every pipeline stage's timeline (:func:`stage_timers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megacann import ops
from megacann import parallel_state as ps
from megacann.pipeline import Timeline
from megacann.training import finetune

if TYPE_CHECKING:
    from megacann.training.trainer import Trainer

# figures of a step that are the trainer's own; every other figure a step returns is the model's
TRAINER_FIGURES = frozenset({"loss", "grad_norm", "lr", "num_tokens", "updated", "skipped", "stage_timers"})


def _context_parallel_note(trainer: Trainer) -> str:
    cfg = trainer.cfg
    d = cfg.distributed
    if d.context_parallel_size == 1:
        return ""
    share = cfg.data.seq_length // d.context_parallel_size
    return f", cp {d.context_parallel_size} {d.context_parallel_algo}: {share} tokens of each sequence per rank"


def start_lines(trainer: Trainer) -> list[str]:
    """The lines a run prints before its first step."""
    cfg, runtime = trainer.cfg, trainer.runtime
    d = cfg.distributed
    lines = [
        f"training {cfg.experiment.name}: {cfg.optim.max_steps} steps, global batch {cfg.global_batch_size} x "
        f"seq {cfg.data.seq_length}, world {runtime.world_size} (tp {d.tensor_parallel_size}, "
        f"pp {d.pipeline_parallel_size}, dp {d.data_parallel_size}{_context_parallel_note(trainer)}), "
        f"device {runtime.accelerator.device_type}, precision {cfg.model.precision}",
        ops.selection_line(runtime.accelerator.device_type),
        finetune.describe_base(trainer.lora_base, cfg),
        trainer.objective.describe(),  # DPO: the loss and the reference policy
        finetune.memory_line(trainer.model_chunks, trainer.optimizer),
    ]
    return [line for line in lines if line]


def step_record(trainer: Trainer, step_metrics: dict[str, Any], step_time: float) -> dict[str, Any]:
    """The logged record of the current step; ``step_time`` is the mean over the steps it stands for."""
    cfg, runtime = trainer.cfg, trainer.runtime
    tps = cfg.global_batch_size * cfg.data.seq_length / step_time
    record = {
        "step": trainer.state.step,
        "loss": step_metrics["loss"],
        "grad_norm": step_metrics["grad_norm"],
        "lr": step_metrics["lr"],
        "tokens_per_second": tps,
        "tokens_per_second_per_device": tps / runtime.world_size,
        "step_time": step_time,
        "consumed_samples": trainer.state.consumed_samples,
    }
    if "stage_timers" in step_metrics:  # per pipeline stage: forward_s, backward_s, *_wait_s, idle_fraction
        record["stage_timers"] = step_metrics["stage_timers"]
    for name, value in step_metrics.items():  # the model's auxiliary losses and stats
        if name not in TRAINER_FIGURES:
            record[name] = value
    if trainer.peak_flops:
        record["mfu"] = tps * trainer.flops_per_token / (runtime.world_size * trainer.peak_flops)
    if cfg.model.precision == "fp16":
        record["loss_scale"] = trainer.optimizer.loss_scale
    if cfg.model.precision == "fp16" or trainer.state.skipped_steps:
        record["skipped_steps"] = trainer.state.skipped_steps
    record.update(runtime.accelerator.memory_stats())
    return record


def stage_timers(timeline: Timeline, device: torch.device) -> dict[str, list[float]]:
    """The last step's ``timeline`` of every pipeline stage (stage 0 first), known on every rank."""
    summary = timeline.summary()
    keys = sorted(summary)
    local = torch.tensor([summary[k] for k in keys], dtype=torch.float32, device=device)
    rows = [local]
    group = ps.get_pipeline_model_parallel_group()
    if group is not None and dist.get_world_size(group) > 1:
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, local, group=group)
    return {k: [round(float(row[i]), 6) for row in rows] for i, k in enumerate(keys)}
