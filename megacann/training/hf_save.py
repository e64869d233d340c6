"""``logging.hf_save_interval``: Hugging Face directories written beside the checkpoints during training.

With ``hf_save_interval: N`` (0: off) the run writes ``<output_dir>/hf_<step>/`` every N steps and at its
last step: ``config.json``, ``model.safetensors`` (the whole model, at any parallel layout; a LoRA run's
adapters merged into its base) and the run's tokenizer, which ``transformers`` loads as they are (see
:mod:`megacann.interop.snapshot`). The write is synchronous and collective; directories are kept (none is
rotated away). A family without a Hugging Face adapter is refused when the recipe is prepared.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megacann.config import ConfigError, MegacannConfig
from megacann.models import ModelSpec

HF_DIR_PREFIX = "hf_"


def hf_save_dir(output_dir: str, step: int) -> str:
    """Where the Hugging Face directory of ``step`` goes."""
    return os.path.join(output_dir, f"{HF_DIR_PREFIX}{step}")


def check_hf_save_config(cfg: MegacannConfig, spec: ModelSpec, source: str = "<recipe>") -> None:
    """``logging.hf_save_interval`` needs a family with a Hugging Face adapter."""
    if cfg.logging.hf_save_interval and spec.hf is None:
        raise ConfigError(
            f"{source}: logging.hf_save_interval: model family {spec.name!r} has no Hugging Face adapter, so its "
            "weights cannot be written as a Hugging Face directory; set logging.hf_save_interval: 0 (checkpoints "
            "still convert with megacann-convert consolidate)"
        )
    if (
        cfg.logging.hf_save_interval
    ):  # what the family's Hugging Face format cannot express: refused now, not at the first write
        try:
            spec.hf.config_to_hf(cfg.model, torch.float32)
        except ConfigError as err:
            raise ConfigError(f"{source}: logging.hf_save_interval: {err}") from None


class HFSaves:
    """When and where a run writes its Hugging Face directories; :meth:`save` is collective."""

    def __init__(self, cfg: MegacannConfig, log: Callable[[str], None]):
        self.cfg, self.log = cfg, log
        self.interval = cfg.logging.hf_save_interval
        self.group: Optional[Any] = None  # gloo over the world: the whole model travels in host memory

    def due(self, step: int) -> bool:
        """Whether ``step`` writes a directory: every ``interval`` steps and the last step, when on."""
        return bool(self.interval) and (step % self.interval == 0 or step == self.cfg.optim.max_steps)

    def save(self, chunks: list, optimizer: Any, tokenizer: Any, step: int) -> str:
        """Write ``<output_dir>/hf_<step>`` from this rank's ``chunks`` (every rank calls it)."""
        from megacann.interop.snapshot import save_hf_snapshot
        from megacann.training.finetune import lora_config

        if optimizer is not None:
            optimizer.finish_param_sync()  # overlapped parameter gathers in flight land first
        if self.group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo")
        start = time.perf_counter()
        path = hf_save_dir(self.cfg.experiment.output_dir, step)
        lora = lora_config(self.cfg) if self.cfg.lora else None
        save_hf_snapshot(chunks, self.cfg.model, path, tokenizer, lora, self.group)
        merged = " (LoRA adapters merged)" if lora is not None else ""
        tok = "" if tokenizer is not None else "; no tokenizer (the run was given its data without one)"
        self.log(f"saved {path}: Hugging Face weights{merged} in {time.perf_counter() - start:.2f} s{tok}")
        return path
