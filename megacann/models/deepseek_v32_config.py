"""The keys of the DeepSeek-V3.2 family (``model.type: deepseek_v32``): DeepSeek-V3's and those of its
sparse attention's lightning indexer. config.json names are Hugging Face's (``DeepseekV32Config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megacann.models.deepseek_config import DeepseekV3ModelConfig


@dataclass
class DeepseekV32ModelConfig(DeepseekV3ModelConfig):
    """DeepSeek-V3.2: DeepSeek-V3 (:class:`DeepseekV3ModelConfig`; ``q_lora_rank`` required) whose every
    attention layer reads only the ``index_topk`` keys a lightning indexer of ``index_n_heads`` heads of
    width ``index_head_dim`` picks per query. Recipe keys of training (no config.json counterpart):
    ``indexer_loss_coeff`` weighs the indexer's KL loss against the attention's distribution (0: the
    indexer does not learn), ``indexer_warmup`` true runs DeepSeek's dense warm-up stage (dense attention,
    every weight but the indexers' frozen)."""

    HF_KEYS: ClassVar[dict[str, str]] = {
        **DeepseekV3ModelConfig.HF_KEYS,
        "index_n_heads": "index_n_heads",
        "index_head_dim": "index_head_dim",
        "index_topk": "index_topk",
    }

    type: str = "deepseek_v32"
    index_n_heads: int = field(default=64, metadata={"shape": True})
    index_head_dim: int = field(default=128, metadata={"shape": True})
    index_topk: int = field(default=2048, metadata={"architecture": True})
    indexer_loss_coeff: float = 1.0
    indexer_warmup: bool = False
