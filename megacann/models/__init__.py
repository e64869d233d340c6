"""Model families built only from megacann.layers, and the contract the rest of megacann knows them by.

``model.type`` names a registered :class:`ModelSpec` (LLaMA, GPT, MoE, Mistral, Qwen2, Qwen3, Qwen3-MoE,
DeepSeek-V3, DeepSeek-V3.2, DeepSeek-V4, gpt-oss, Qwen3.5, Qwen3.5-MoE and Qwen3-Next here; docs/models.md lists them); a script
registers its own with :func:`register_model` or hands one to ``Trainer(cfg, model_spec=...)``. A family owns its Hugging Face adapter (:class:`HFAdapter`: names
and settings, as data); reading and writing the directories is :mod:`megacann.interop`'s
(``megacann.interop.from_pretrained_hf`` / ``save_pretrained_hf``), which this package never imports.
"""

from __future__ import annotations

from megacann.models.contract import ChunkOutput, count_target_tokens
from megacann.models.decoder import DecoderArch, DecoderLM, decoder_model_spec
from megacann.models.deepseek import DEEPSEEK_V3, DeepseekV3Model
from megacann.models.deepseek_v4 import DEEPSEEK_V4, DeepseekV4Model
from megacann.models.deepseek_v32 import DEEPSEEK_V32, DeepseekV32Model
from megacann.models.gpt import GPT, GPTModel
from megacann.models.gpt_oss import GPT_OSS, GptOssModel
from megacann.models.llama import LLAMA, LlamaModel
from megacann.models.mistral import MISTRAL, MistralModel, MistralModelConfig
from megacann.models.moe import MOE, MoEModel
from megacann.models.qwen import QWEN2, QWEN3, QWEN3_MOE, Qwen2Model, Qwen3Model, Qwen3MoeModel
from megacann.models.qwen3_5 import QWEN3_5, Qwen35Model
from megacann.models.qwen3_5_moe import QWEN3_5_MOE, Qwen35MoeModel
from megacann.models.qwen3_next import QWEN3_NEXT, Qwen3NextModel
from megacann.models.sizing import padded_vocab_size
from megacann.models.spec import (
    ChunkPlacement,
    HFAdapter,
    ModelSpec,
    decoder_forward_step,
    family_import,
    find_hf_family,
    get_model_spec,
    layer_context_from_config,
    prepare_model_config,
    register_model,
    registered_models,
)

register_model(LLAMA)
register_model(GPT)
register_model(MOE)
register_model(MISTRAL)
register_model(QWEN2)
register_model(QWEN3)
register_model(QWEN3_MOE)
register_model(DEEPSEEK_V3)
register_model(DEEPSEEK_V32)
register_model(DEEPSEEK_V4)
register_model(GPT_OSS)
register_model(QWEN3_5)
register_model(QWEN3_5_MOE)
register_model(QWEN3_NEXT)

__all__ = [
    "DEEPSEEK_V3",
    "DEEPSEEK_V32",
    "DEEPSEEK_V4",
    "GPT",
    "GPT_OSS",
    "LLAMA",
    "MISTRAL",
    "MOE",
    "QWEN2",
    "QWEN3",
    "QWEN3_5",
    "QWEN3_5_MOE",
    "QWEN3_NEXT",
    "QWEN3_MOE",
    "ChunkOutput",
    "ChunkPlacement",
    "DecoderArch",
    "DecoderLM",
    "DeepseekV3Model",
    "DeepseekV32Model",
    "DeepseekV4Model",
    "GPTModel",
    "GptOssModel",
    "HFAdapter",
    "LlamaModel",
    "MistralModel",
    "MistralModelConfig",
    "ModelSpec",
    "MoEModel",
    "Qwen2Model",
    "Qwen35Model",
    "Qwen3NextModel",
    "Qwen35MoeModel",
    "Qwen3Model",
    "Qwen3MoeModel",
    "count_target_tokens",
    "decoder_forward_step",
    "decoder_model_spec",
    "family_import",
    "find_hf_family",
    "get_model_spec",
    "layer_context_from_config",
    "padded_vocab_size",
    "prepare_model_config",
    "register_model",
    "registered_models",
]
