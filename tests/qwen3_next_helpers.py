"""Tiny random Qwen3-Next checkpoints written by transformers, for the qwen3_next family tests: Qwen3.5-MoE's
tiny shape (:mod:`qwen3_5_helpers`) with a dense layer (``mlp_only_layers``) wider than an expert."""

from __future__ import annotations

import torch
from qwen3_5_helpers import MOE_SHAPE, hf_logits, tiny_hf_qwen3_5

SHAPE = {
    **{k: v for k, v in MOE_SHAPE.items() if k != "rope_parameters"},
    "intermediate_size": 40,
    "mlp_only_layers": [1],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}


def hf_classes() -> tuple:
    """transformers' (Qwen3NextConfig, Qwen3NextForCausalLM)."""
    import transformers

    return transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM


def tiny_hf_qwen3_next(path: str, seed: int = 3, std: float = 0.1, **settings) -> str:
    """A tiny Qwen3-Next directory written by transformers, every parameter drawn at random."""
    return tiny_hf_qwen3_5(path, seed, moe=True, std=std, classes=hf_classes(), **{**SHAPE, **settings})


def hf_next_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits of the Qwen3-Next directory ``path`` for ``ids``."""
    return hf_logits(path, ids, model_class=hf_classes()[1])
