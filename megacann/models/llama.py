"""LLaMA: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, tied or untied head."""

from __future__ import annotations

from dataclasses import replace

from megacann.config import ModelConfig
from megacann.models.decoder import DecoderLM


class LlamaModel(DecoderLM):
    """A LLaMA-family model (LLaMA 1/2/3, Mistral-style GQA). See :class:`DecoderLM` for forward."""

    def __init__(self, cfg: ModelConfig, **kwargs):
        if cfg.type != "llama":
            cfg = replace(cfg, type="llama")
        super().__init__(cfg, **kwargs)

    def save_pretrained_hf(self, path: str) -> None:
        """Write a Hugging Face LLaMA directory (config.json + safetensors) that transformers loads."""
        from megacann.models.hf_llama import save_pretrained_hf

        save_pretrained_hf([self], path)
