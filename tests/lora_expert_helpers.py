"""Shared pieces of the expert-LoRA tests: a tiny MoE decoder, adapters with a non-zero B, logits."""

from __future__ import annotations

import functools

import torch

from megacann.config import MegacannConfig
from megacann.layers import (
    init_adapters_,
    init_normal,
    initialize_weights,
    lora_adapters,
    parameter_seed,
)
from megacann.layers.sharding import init_sharded_
from megacann.models import MOE, ChunkPlacement, prepare_model_config
from megacann.models.moe_config import MoEModelConfig

TOL = 1e-5
H, FFN, E = 32, 16, 4
IDS = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))


def tiny_moe_model(seed: int = 3, **changes) -> torch.nn.Module:
    """A tiny Mixtral-like MoE decoder (2 layers, 4 experts, top 2) on one process."""
    m = MoEModelConfig(
        hidden_size=H, num_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=61,
        num_experts=E, moe_top_k=2, moe_ffn_hidden_size=FFN, precision="fp32", **changes,
    )  # fmt: skip
    cfg = MegacannConfig(model=m)
    prepare_model_config(cfg)
    model = MOE.build_chunk(cfg, ChunkPlacement((0, 1)), "cpu")
    initialize_weights(model, seed)
    return model.eval()


def randomise_adapters(model: torch.nn.Module, seed: int = 5) -> None:
    """Adapters drawn by name, then a non-zero B (also by name), so they change the output."""
    init_adapters_(model, functools.partial(parameter_seed, seed))
    for name, adapter in lora_adapters(model):
        key = f"{name}.adapter.lora_B"
        init_sharded_(adapter.lora_B, init_normal(0.3), adapter.tp_rank, adapter.tp_size, parameter_seed(9, key))


def model_logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids)
