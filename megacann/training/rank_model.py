"""This rank's model chunks, each weight drawn once, or not at all when it is about to be loaded.

Building draws nothing at construction (:func:`megacann.layers.deferred_initialization`): the family's
``initialize_weights`` draws every parameter once, by name, this rank's blocks only. With
``model.init_from``, or a checkpoint to resume that holds the whole model, nothing is drawn: the memory is
allocated and the loader fills every parameter.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from megacann.config import MegacannConfig
from megacann.layers import deferred_initialization, initialize_undrawn
from megacann.models import ModelSpec
from megacann.pipeline import build_model_chunks


def weights_will_load(cfg: MegacannConfig, checkpoint_follows: bool = False) -> bool:
    """Whether every weight of the model is loaded after it is built: ``model.init_from`` is set, or a
    checkpoint follows that holds the whole model (a LoRA run's holds only the adapters: without
    ``model.init_from`` its base is drawn from the seed)."""
    return bool(cfg.model.init_from) or (checkpoint_follows and not cfg.lora)


def build_rank_chunks(
    cfg: MegacannConfig,
    spec: ModelSpec,
    device: Optional[Union[torch.device, str]] = None,
    checkpoint_follows: bool = False,
) -> list[torch.nn.Module]:
    """This rank's chunks (:func:`megacann.pipeline.build_model_chunks`), drawn from ``cfg.seed`` or, when
    :func:`weights_will_load`, left undrawn for the loader."""
    loaded = weights_will_load(cfg, checkpoint_follows)
    with deferred_initialization(weights_loaded=loaded):
        chunks = build_model_chunks(cfg, spec, device=device)
    if not loaded:  # a family whose builder relied on drawing at construction
        initialize_undrawn(chunks, cfg.seed)
    return chunks
