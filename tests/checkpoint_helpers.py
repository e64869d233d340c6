"""Shared pieces of the checkpoint tests: build a trainer on synthetic data, train, gather results.

All functions run inside a rank (see dist_harness); each ``make_trainer`` starts from fresh parallel
groups and seeds, as a new process would.
"""

from __future__ import annotations

import torch.distributed as dist
from training_helpers import synthetic_data_factory, tiny_config

from megacann import parallel_state as ps
from megacann.interop.full_state import full_state_dict
from megacann.training.runtime import setup_runtime
from megacann.training.trainer import Trainer

# dropout on, so a resumed run is bitwise equal only if every RNG stream is restored
COMMON = ["optim.clip_grad=0.5", "optim.lr=1e-3", "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]


def make_trainer(overrides: list[str], output_dir: str, max_steps: int = 6) -> Trainer:
    ps.destroy_model_parallel()
    cfg = tiny_config(
        COMMON + [f"experiment.output_dir={output_dir}", f"optim.max_steps={max_steps}"] + list(overrides),
        world_size=dist.get_world_size(),
    )
    runtime = setup_runtime(cfg)
    return Trainer(cfg, runtime, data_factory=synthetic_data_factory(cfg))


def run_steps(trainer: Trainer, steps: int) -> list[tuple[float, float]]:
    """(loss, grad_norm) of the next ``steps`` optimizer steps."""
    out = []
    for _ in range(steps):
        metrics = trainer.train_step()
        out.append((metrics["loss"], metrics["grad_norm"]))
    return out


def weights(trainer: Trainer) -> dict:
    """Whole weights, joined over TP and (on rank 0) over pipeline stages; None on other ranks."""
    trainer.optimizer.finish_param_sync()
    local = full_state_dict(trainer.model_chunks)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        parts: list = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(parts, local, group=ps.get_pipeline_model_parallel_group())
        local = {k: v for part in parts for k, v in part.items()}
    return local if dist.get_rank() == 0 else None
