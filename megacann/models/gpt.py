"""GPT: learned positions, LayerNorm, GELU MLP, biases, usually tied input/output embeddings."""

from __future__ import annotations

from megacann.config import ModelConfig
from megacann.models.decoder import DecoderArch, DecoderLM, decoder_model_spec


def gpt_defaults(cfg: ModelConfig) -> None:
    """GPT's MLP width (4h) and biases, unless the recipe says otherwise."""
    if cfg.ffn_hidden_size is None and cfg.hidden_size:
        cfg.ffn_hidden_size = 4 * cfg.hidden_size
    if cfg.add_bias_linear is None:
        cfg.add_bias_linear = True


class GPTModel(DecoderLM):
    """A GPT-2/3 style model. See :class:`DecoderLM` for forward."""

    ARCH = DecoderArch(normalization="layernorm", activation="gelu", position_embedding="learned")
    fill_defaults = staticmethod(gpt_defaults)


GPT = decoder_model_spec("gpt", GPTModel)  # seq_length vs positions: config/validation.py
