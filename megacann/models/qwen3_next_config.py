"""The keys of the Qwen3-Next family (``model.type: qwen3_next``), Hugging Face's ``Qwen3NextConfig``: Qwen3.5's
hybrid layers (:mod:`megacann.models.qwen3_5_config`) with Qwen3-MoE's choice of MoE layers
(:mod:`megacann.models.qwen_config`) and a gated shared expert."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from megacann.config import ConfigError
from megacann.models.qwen3_5_config import _HYBRID_HF_KEYS, FULL, LINEAR, _HybridKeys
from megacann.models.qwen_config import Qwen3MoeModelConfig

FULL_ATTENTION_INTERVAL_KEY = "full_attention_interval"  # config.json's other way to give layer_types


@dataclass
class Qwen3NextModelConfig(_HybridKeys, Qwen3MoeModelConfig):
    """Qwen3-Next: the hybrid layers (``layer_types``: Gated DeltaNet or gated full attention); layer ``i``
    an MoE layer when ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers`` (a
    dense SwiGLU of width ``ffn_hidden_size`` there); softmax routing over ``num_experts``, top
    ``moe_top_k`` renormalised when ``norm_topk_prob``; one shared expert of width
    ``shared_expert_intermediate_size`` gated per token by ``sigmoid(x · g)``."""

    HF_KEYS: ClassVar[dict[str, str]] = {
        **Qwen3MoeModelConfig.HF_KEYS,
        **_HYBRID_HF_KEYS,
        "shared_expert_intermediate_size": "shared_expert_intermediate_size",
    }

    type: str = "qwen3_next"
    norm_topk_prob: bool = field(default=True, metadata={"architecture": True})
    shared_expert_intermediate_size: Optional[int] = field(default=None, metadata={"shape": True})


def layer_types_from_interval(raw: dict[str, Any], path: str) -> Optional[list[str]]:
    """The ``layer_types`` config.json's ``full_attention_interval`` gives (every N-th layer full attention,
    as transformers fills them), or None when it does not set one."""
    interval = raw.get(FULL_ATTENTION_INTERVAL_KEY)
    if interval is None or raw.get("layer_types") is not None:
        return None
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ConfigError(f"{path}: {FULL_ATTENTION_INTERVAL_KEY} must be a positive integer, got {interval!r}")
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(raw["num_hidden_layers"])]
