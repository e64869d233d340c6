"""The keys of the DeepSeek-V3 family (``model.type: deepseek_v3``), on top of those every MoE model has.
Their config.json names are Hugging Face's (``DeepseekV3Config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

from megacann.models.moe_config import MoEModelConfig


@dataclass
class DeepseekV3ModelConfig(MoEModelConfig):
    """DeepSeek-V3 (and models of its layout: Moonlight, DeepSeek-V3-style 16B): multi-head latent
    attention (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
    ``v_head_dim``), sigmoid routing with a per-expert bias, group-limited top-k (``n_group`` groups, the
    best ``topk_group`` of them), ``norm_topk_prob``, ``routed_scaling_factor``, ``moe_shared_experts``
    (config.json ``n_shared_experts``) shared experts, and the first ``first_k_dense_replace`` layers
    dense (MLP of width ``ffn_hidden_size``; the experts are ``moe_ffn_hidden_size`` wide).
    ``moe_layer_freq`` is derived from ``first_k_dense_replace``. config.json's
    ``num_nextn_predict_layers`` is ``mtp_num_layers`` (multi-token prediction depths, each with a layer
    of the last layer's kind: :mod:`megacann.models.mtp`). ``head_dim`` and
    ``qk_head_dim``, which transformers' config.json carries, must be ``qk_rope_head_dim`` and
    ``qk_nope_head_dim + qk_rope_head_dim`` when set. DeepSeek's own config.json (``trust_remote_code``)
    carries the balancing loss as ``aux_loss_alpha`` (``moe_aux_loss_coeff``) and ``seq_aux`` (true:
    ``moe_router_load_balancing_type: seq_aux_loss``, false: ``aux_loss``)."""

    HF_KEYS: ClassVar[dict[str, str]] = {
        **MoEModelConfig.HF_KEYS,
        "n_routed_experts": "num_experts",
        "moe_intermediate_size": "moe_ffn_hidden_size",
        "n_shared_experts": "moe_shared_experts",
        "rope_interleave": "rotary_interleaved",
        "num_nextn_predict_layers": "mtp_num_layers",  # multi-token prediction depths (megacann.models.mtp)
        "num_mtp_layers": "mtp_num_layers",  # transformers' other name of it
        "aux_loss_alpha": "moe_aux_loss_coeff",  # DeepSeek's own config.json: the balancing loss weight
    }
    # DeepSeek's own config.json: seq_aux says whether that loss is taken per sequence
    HF_VALUE_KEYS: ClassVar[dict[str, tuple[str, dict]]] = {
        **MoEModelConfig.HF_VALUE_KEYS,
        "seq_aux": ("moe_router_load_balancing_type", {True: "seq_aux_loss", False: "aux_loss"}),
    }
    # DeepSeek's own config.json (trust_remote_code) names its routing; only DeepSeek-V3's is read
    HF_INERT_KEYS: ClassVar[dict[str, object]] = {
        **MoEModelConfig.HF_INERT_KEYS,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
        "ep_size": 1,
    }
    # config.json's quantization_config (DeepSeek-V3's published fp8 weights with block scales) is no model
    # setting: the weight import dequantises such weights as it reads them (megacann.interop.quantized)

    type: str = "deepseek_v3"
    moe_router: str = field(default="sigmoid", metadata={"architecture": True, "choices": ("sigmoid",)})
    rotary_interleaved: bool = True  # config.json rope_interleave (transformers' default: true)
    q_lora_rank: Optional[int] = field(default=None, metadata={"shape": True})  # None: one q_proj
    kv_lora_rank: int = field(default=512, metadata={"shape": True})
    qk_nope_head_dim: int = field(default=128, metadata={"shape": True})
    qk_rope_head_dim: int = field(default=64, metadata={"shape": True})
    v_head_dim: int = field(default=128, metadata={"shape": True})
    n_group: int = field(default=1, metadata={"architecture": True})
    topk_group: int = field(default=1, metadata={"architecture": True})
    norm_topk_prob: bool = field(default=True, metadata={"architecture": True})
    routed_scaling_factor: float = field(default=1.0, metadata={"architecture": True})
    first_k_dense_replace: int = field(default=0, metadata={"shape": True})
    # what transformers writes beside the shapes (the rotary width and q/k head width): read, checked
    head_dim: Optional[int] = None
    qk_head_dim: Optional[int] = None
    # derived from first_k_dense_replace (None until the family fills it in)
    moe_layer_freq: Union[int, list, None] = field(default=None, metadata={"shape": True})


def deepseek_layer_flags(cfg: DeepseekV3ModelConfig) -> list[int]:
    """Which layers are MoE layers (1): all from ``first_k_dense_replace`` on."""
    return [int(i >= cfg.first_k_dense_replace) for i in range(cfg.num_layers)]
