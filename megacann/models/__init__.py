"""Example models built only from megacann.layers, their sizes and FLOPs, and Hugging Face interop."""

from __future__ import annotations

from typing import Optional, Union

import torch

from megacann import parallel_state as ps
from megacann.config import MegacannConfig
from megacann.models.decoder import DecoderLM, initialize_weights
from megacann.models.gpt import GPTModel
from megacann.models.llama import LlamaModel
from megacann.models.sizing import flops_per_token, num_parameters, padded_vocab_size

MODEL_CLASSES = {"llama": LlamaModel, "gpt": GPTModel}
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_model(
    cfg: MegacannConfig,
    *,
    layer_ids: Optional[list[int]] = None,
    pre_process: bool = True,
    post_process: bool = True,
    device: Optional[Union[torch.device, str]] = None,
) -> DecoderLM:
    """One model chunk of the recipe's type, in the recipe's precision, initialised from ``cfg.seed``."""
    cls = MODEL_CLASSES.get(cfg.model.type)
    if cls is None:
        raise NotImplementedError(f"model.type {cfg.model.type!r} has no model yet; available: {sorted(MODEL_CLASSES)}")
    model = cls(
        cfg.model,
        sequence_parallel=cfg.distributed.sequence_parallel,
        layer_ids=layer_ids,
        pre_process=pre_process,
        post_process=post_process,
        params_dtype=PRECISION_DTYPES[cfg.model.precision],
        device=device,
    )
    initialize_weights(model, cfg.seed)
    return model


def build_model_chunks(cfg: MegacannConfig, device: Optional[Union[torch.device, str]] = None) -> list[DecoderLM]:
    """This rank's model chunks: one per virtual pipeline stage (one in all without pipelining)."""
    from megacann.pipeline.partition import stage_layer_ids

    d = cfg.distributed
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    vpp = d.virtual_pipeline_size or 1
    chunks = []
    for vp_rank in range(vpp):
        layer_ids = stage_layer_ids(cfg.model.num_layers, pp_size, pp_rank, vpp, vp_rank, d.pipeline_layers)
        chunks.append(
            build_model(
                cfg,
                layer_ids=layer_ids,
                pre_process=pp_rank == 0 and vp_rank == 0,
                post_process=pp_rank == pp_size - 1 and vp_rank == vpp - 1,
                device=device,
            )
        )
    return chunks


def from_pretrained_hf(path: str, **kwargs) -> LlamaModel:
    """Load a local Hugging Face LLaMA directory (config.json + safetensors) into a LlamaModel."""
    from megacann.models.hf_llama import from_pretrained_hf as load

    return load(path, **kwargs)


__all__ = [
    "DecoderLM",
    "GPTModel",
    "LlamaModel",
    "build_model",
    "build_model_chunks",
    "flops_per_token",
    "from_pretrained_hf",
    "num_parameters",
    "padded_vocab_size",
]
