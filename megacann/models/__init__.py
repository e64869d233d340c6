"""Model families built only from megacann.layers, the contract the rest of megacann knows them by, and
Hugging Face interop.

``model.type`` names a registered :class:`ModelSpec` (LLaMA, GPT and MoE here); a script registers its own
with :func:`register_model` or hands one to ``Trainer(cfg, model_spec=...)``.
"""

from __future__ import annotations

from megacann.models.decoder import DecoderArch, DecoderLM, decoder_model_spec
from megacann.models.gpt import GPT, GPTModel
from megacann.models.hf import from_pretrained_hf
from megacann.models.llama import LLAMA, LlamaModel
from megacann.models.moe import MOE, MoEModel
from megacann.models.sizing import padded_vocab_size
from megacann.models.spec import (
    ChunkPlacement,
    HFAdapter,
    ModelSpec,
    decoder_forward_step,
    find_hf_family,
    get_model_spec,
    prepare_model_config,
    register_model,
    registered_models,
)
from megacann.models.step_loss import count_target_tokens

register_model(LLAMA)
register_model(GPT)
register_model(MOE)

__all__ = [
    "GPT",
    "LLAMA",
    "MOE",
    "ChunkPlacement",
    "DecoderArch",
    "DecoderLM",
    "GPTModel",
    "HFAdapter",
    "LlamaModel",
    "ModelSpec",
    "MoEModel",
    "count_target_tokens",
    "decoder_forward_step",
    "decoder_model_spec",
    "find_hf_family",
    "from_pretrained_hf",
    "get_model_spec",
    "padded_vocab_size",
    "prepare_model_config",
    "register_model",
    "registered_models",
]
