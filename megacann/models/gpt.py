"""GPT: learned positions, LayerNorm, GELU MLP, biases, usually tied input/output embeddings."""

from __future__ import annotations

from dataclasses import replace

from megacann.config import ModelConfig
from megacann.models.decoder import DecoderLM


class GPTModel(DecoderLM):
    """A GPT-2/3 style model. See :class:`DecoderLM` for forward."""

    def __init__(self, cfg: ModelConfig, **kwargs):
        if cfg.type != "gpt":
            cfg = replace(cfg, type="gpt")
        super().__init__(cfg, **kwargs)
