"""LLaMA: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, tied or untied head."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megacann.config import ModelConfig
from megacann.models.decoder import DecoderArch, DecoderLM, decoder_model_spec
from megacann.models.hf_llama import LLAMA_HF
from megacann.models.mtp import MTPKeys


@dataclass
class LlamaModelConfig(MTPKeys, ModelConfig):
    """The keys of ``model.type: llama``: those every decoder has, and multi-token prediction's."""

    type: str = "llama"


def llama_defaults(cfg: ModelConfig) -> None:
    """LLaMA's MLP width (2/3 of 4h, rounded up to 256) and no biases, unless the recipe says otherwise."""
    if cfg.ffn_hidden_size is None and cfg.hidden_size:
        cfg.ffn_hidden_size = 256 * ((int(2 * 4 * cfg.hidden_size / 3) + 255) // 256)
    if cfg.add_bias_linear is None:
        cfg.add_bias_linear = False


class LlamaModel(DecoderLM):
    """A LLaMA-family model (LLaMA 1/2/3, Mistral-style GQA). See :class:`DecoderLM` for forward."""

    ARCH = DecoderArch(normalization="rmsnorm", activation="swiglu", position_embedding="rope")
    fill_defaults = staticmethod(llama_defaults)


LLAMA = replace(decoder_model_spec("llama", LlamaModel, hf=LLAMA_HF), config_class=LlamaModelConfig)
