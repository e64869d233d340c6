"""Saving and loading one rank's full training state (same layout; resharding is a later format)."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.checkpoint.files import COMPLETE_MARKER, checkpoint_dir, rotate, write_latest

if TYPE_CHECKING:
    from megacann.training.trainer import Trainer

FORMAT_VERSION = 1


def rng_state(trainer: Trainer) -> dict[str, Any]:
    from megacann.layers import get_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": trainer.runtime.accelerator.get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
    }


def set_rng_state(trainer: Trainer, state: dict[str, Any]) -> None:
    from megacann.layers import get_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    trainer.runtime.accelerator.set_rng_state(state["device"])
    get_rng_tracker().set_states(state["tracker"])


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _layout() -> dict[str, int]:
    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "tensor_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
    }


def save_checkpoint(trainer: Trainer) -> str:
    """Write ``checkpoint_<step>`` atomically: every rank writes into a temporary directory, rank 0
    renames it, marks it complete, then updates ``latest`` and rotates old checkpoints."""
    cfg = trainer.cfg
    out = cfg.experiment.output_dir
    step = trainer.state.step
    final = checkpoint_dir(out, step)
    tmp = final + ".tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    start = time.perf_counter()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    state = {
        "model": [chunk.state_dict() for chunk in trainer.model_chunks],
        "optimizer": trainer.optimizer.state_dict(),
        "train_state": trainer.train_state_dict(),
        "rng": rng_state(trainer),
    }
    path = os.path.join(tmp, f"rank_{rank:05d}.pt")
    torch.save(state, path)
    nbytes = os.path.getsize(path)
    _barrier()
    if rank == 0:
        meta = {"format_version": FORMAT_VERSION, "step": step, "layout": _layout(), "config": cfg.to_dict()}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(final, COMPLETE_MARKER), "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        write_latest(out, final)
        rotate(out, cfg.logging.keep_last)
    _barrier()
    seconds = time.perf_counter() - start
    trainer.metrics.print(f"saved {final} in {seconds:.2f} s ({nbytes / 2**20 / max(seconds, 1e-9):.1f} MB/s per rank)")
    return final


def load_checkpoint(trainer: Trainer, path: str) -> None:
    """Restore this rank's state from ``path`` (written under the same parallel layout)."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta["layout"] != _layout():
        raise ValueError(f"{path}: written under layout {meta['layout']}, this run is {_layout()}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = torch.load(os.path.join(path, f"rank_{rank:05d}.pt"), map_location="cpu", weights_only=False)
    for chunk, chunk_state in zip(trainer.model_chunks, state["model"]):
        chunk.load_state_dict(chunk_state)
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.load_train_state_dict(state["train_state"])
    set_rng_state(trainer, state["rng"])
