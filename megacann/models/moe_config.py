"""The keys of the mixture-of-experts family (``model.type: moe``), on top of those every decoder has."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

from megacann.config import ModelConfig
from megacann.models.mtp import MTPKeys

ROUTER_SCORES = ("softmax", "sigmoid")
BALANCING_LOSSES = ("aux_loss", "seq_aux_loss")  # Megatron-Core's names (megacann.layers.moe.LOAD_BALANCING_TYPES)


@dataclass
class MoEModelConfig(MTPKeys, ModelConfig):
    """A decoder whose feed-forward blocks are mixtures of experts (Mixtral, DeepSeek-style routing), with
    multi-token prediction's keys (:class:`~megacann.models.mtp.MTPKeys`)."""

    HF_KEYS: ClassVar[dict[str, str]] = {
        **ModelConfig.HF_KEYS,
        "num_local_experts": "num_experts",  # Mixtral
        "num_experts_per_tok": "moe_top_k",
        "router_aux_loss_coef": "moe_aux_loss_coeff",
    }
    HF_INERT_KEYS: ClassVar[dict[str, object]] = {**ModelConfig.HF_INERT_KEYS, "router_jitter_noise": 0.0}

    type: str = "moe"
    num_experts: Optional[int] = field(default=None, metadata={"shape": True})  # routed experts per MoE layer
    moe_top_k: int = field(default=2, metadata={"architecture": True})  # experts per token
    # softmax (Mixtral) | sigmoid (DeepSeek-V3) scores
    moe_router: str = field(default="softmax", metadata={"architecture": True, "choices": ROUTER_SCORES})
    moe_capacity_factor: Optional[float] = None  # None: dropless; else tokens per expert capped
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss weight
    # what that loss balances: aux_loss (the micro-batch's tokens) | seq_aux_loss (each sequence, DeepSeek-V2/V3)
    moe_router_load_balancing_type: str = field(default="aux_loss", metadata={"choices": BALANCING_LOSSES})
    moe_z_loss_coeff: float = 0.0  # router z-loss weight
    moe_bias_update_rate: float = 0.0  # auxiliary-loss-free balancing step (0: off)
    # every N-th layer is MoE (from layer 0), or a 0/1 flag per layer
    moe_layer_freq: Union[int, list] = field(default=1, metadata={"shape": True})
    moe_shared_experts: int = field(default=0, metadata={"shape": True})  # shared experts every token passes through
    moe_ffn_hidden_size: Optional[int] = field(
        default=None, metadata={"shape": True}
    )  # one expert; None: ffn_hidden_size
