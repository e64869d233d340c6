"""The Hugging Face adapter of the DeepSeek-V3.2 family: ``DeepseekV32ForCausalLM`` checkpoints.

Weights map as DeepSeek-V3's (:mod:`megacann.models.hf_deepseek`); each layer's indexer is named alike on
both sides (``layers.<i>.self_attn.indexer.{wq_b, wk, k_norm, weights_proj}``, ``model.`` prefixed there).
config.json adds ``index_n_heads``, ``index_head_dim`` and ``index_topk``; its ``layer_types`` (every
layer ``indexed_attention``) and ``mlp_layer_types`` (dense up to ``first_k_dense_replace``, then
``sparse``) are checked against what megacann builds and refused, naming the key, when they differ.
transformers' DeepSeek-V3.2 always rotates interleaved pairs and always has the low-rank query.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megacann.config import ConfigError, ModelConfig
from megacann.config.hf_config import read_hf_config
from megacann.models import hf_deepseek
from megacann.models.spec import HFAdapter

INDEXED = "indexed_attention"


def mlp_layer_types(cfg: ModelConfig) -> list[str]:
    """config.json's ``mlp_layer_types``: ``dense`` for the first ``first_k_dense_replace`` layers, then ``sparse``."""
    dense = min(cfg.first_k_dense_replace, cfg.num_layers)
    return ["dense"] * dense + ["sparse"] * (cfg.num_layers - dense)


def _check_layer_lists(raw: dict[str, Any], cfg: ModelConfig, config_file: str) -> None:
    expected = {"layer_types": [INDEXED] * cfg.num_layers, "mlp_layer_types": mlp_layer_types(cfg)}
    for key, want in expected.items():
        if raw.get(key) is not None and list(raw[key]) != want:
            raise ConfigError(
                f"{config_file}: {key} {raw[key]!r} is not implemented by megacann's deepseek_v32 (expected {want!r}: "
                "every layer indexed attention, MLPs dense up to first_k_dense_replace)"
            )
    if raw.get("rope_interleave", True) is not True:
        raise ConfigError(
            f"{config_file}: rope_interleave {raw['rope_interleave']!r} is refused: DeepSeek-V3.2 rotates interleaved pairs"
        )
    if cfg.q_lora_rank is None:
        raise ConfigError(f"{config_file}: q_lora_rank null is refused: DeepSeek-V3.2's indexer reads the query latent")


def config_from_hf(config_file: str, raw: Optional[dict[str, Any]] = None) -> ModelConfig:
    """A deepseek_v32 ModelConfig from config.json (see the module docstring for what is refused)."""
    raw = read_hf_config(config_file) if raw is None else raw
    lists = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types")}
    cfg = hf_deepseek.config_from_hf(config_file, lists, family="deepseek_v32")
    _check_layer_lists(raw, cfg, config_file)
    return cfg


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a ``DeepseekV32ForCausalLM`` with ``cfg``'s settings."""
    config = hf_deepseek.hf_config_dict(cfg, dtype)
    config.pop("rope_interleave")
    config.update(
        architectures=["DeepseekV32ForCausalLM"],
        model_type="deepseek_v32",
        index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        layer_types=[INDEXED] * cfg.num_layers,
        mlp_layer_types=mlp_layer_types(cfg),
    )
    return config


DEEPSEEK_V32_HF = HFAdapter(
    model_types=("deepseek_v32",),
    config_from_hf=config_from_hf,
    config_to_hf=hf_config_dict,
    to_hf=hf_deepseek.to_hf_tensors,
    from_hf=hf_deepseek.from_hf_tensors,
    linear_parts=hf_deepseek.hf_parts,
    fit_to_weights=hf_deepseek.fit_mtp_to_weights,
)
