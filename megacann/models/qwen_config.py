"""The keys of the Qwen families (``model.type: qwen2``, ``qwen3``, ``qwen3_moe``), on top of those every
decoder (and, for Qwen3-MoE, every MoE model) has. Their config.json names are Hugging Face's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

from megacann.config import ModelConfig
from megacann.models.moe_config import MoEModelConfig


def _without_window(inert: dict[str, object]) -> dict[str, object]:
    """Qwen's config.json keeps a window size even where sliding windows are off (use_sliding_window:
    false); the size then means nothing, so it is not refused (megacann notes it as unused)."""
    return {k: v for k, v in inert.items() if k != "sliding_window"}


@dataclass
class _QwenKeys:
    """What every Qwen family reads besides the shared keys: whether sliding windows are on (refused)."""

    use_sliding_window: bool = field(default=False, metadata={"architecture": True})


@dataclass
class _Qwen3Keys(_QwenKeys):
    """Qwen3 attention: heads of their own width (``head_dim``; None: hidden_size / num_attention_heads)."""

    head_dim: Optional[int] = field(default=None, metadata={"shape": True})


@dataclass
class Qwen2ModelConfig(_QwenKeys, ModelConfig):
    """Qwen2 / Qwen2.5: LLaMA with biases on the q, k and v projections."""

    HF_INERT_KEYS: ClassVar[dict[str, object]] = _without_window(ModelConfig.HF_INERT_KEYS)

    type: str = "qwen2"


@dataclass
class Qwen3ModelConfig(_Qwen3Keys, ModelConfig):
    """Qwen3 (dense): LLaMA with an RMSNorm on every query and key head, and heads of width ``head_dim``."""

    HF_KEYS: ClassVar[dict[str, str]] = {**ModelConfig.HF_KEYS, "head_dim": "head_dim"}
    HF_INERT_KEYS: ClassVar[dict[str, object]] = _without_window(ModelConfig.HF_INERT_KEYS)

    type: str = "qwen3"


@dataclass
class Qwen3MoeModelConfig(_Qwen3Keys, MoEModelConfig):
    """Qwen3-MoE: Qwen3 attention; MoE layers of ``num_experts`` experts of width ``moe_ffn_hidden_size``
    (config.json: ``moe_intermediate_size``), softmax over all experts then top ``moe_top_k``, renormalised
    when ``norm_topk_prob``. Layer ``i`` is an MoE layer when ``(i + 1) % decoder_sparse_step == 0`` and
    ``i`` is not in ``mlp_only_layers`` (dense MLP of width ``ffn_hidden_size`` there);
    ``moe_layer_freq`` is derived from those two."""

    HF_KEYS: ClassVar[dict[str, str]] = {
        **MoEModelConfig.HF_KEYS,
        "head_dim": "head_dim",
        "moe_intermediate_size": "moe_ffn_hidden_size",
    }
    HF_INERT_KEYS: ClassVar[dict[str, object]] = _without_window(MoEModelConfig.HF_INERT_KEYS)

    type: str = "qwen3_moe"
    norm_topk_prob: bool = field(default=False, metadata={"architecture": True})
    decoder_sparse_step: int = field(default=1, metadata={"shape": True})
    mlp_only_layers: list = field(default_factory=list, metadata={"shape": True})
    # derived from decoder_sparse_step and mlp_only_layers (None until the family fills it in)
    moe_layer_freq: Union[int, list, None] = field(default=None, metadata={"shape": True})


def qwen3_moe_layer_flags(cfg: ModelConfig) -> list[int]:
    """Which layers are MoE layers (1) and which dense (0), by Qwen3-MoE's rule (see the config class)."""
    step, dense = cfg.decoder_sparse_step, set(cfg.mlp_only_layers)
    return [int((i + 1) % step == 0 and i not in dense) for i in range(cfg.num_layers)]
