"""The keys of the DeepSeek-V4 family (``model.type: deepseek_v4``), on top of those every MoE model has.
Their config.json names are Hugging Face's (``DeepseekV4Config`` of transformers 5.25), and so are the
values of the per-layer lists; what megacann does not implement is refused naming the key and value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from megacann.config import ConfigError, ModelConfig
from megacann.models.layer_types import check_layer_types
from megacann.models.moe_config import MoEModelConfig

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
MLP_TYPES = (HASH_MOE, MOE)
V4_ROUTER_SCORES = ("sqrtsoftplus", "softmax", "sigmoid")  # config.json scoring_func
ROPE_KINDS = ("main", "compress")  # rope_parameters: sliding layers rotate by "main", the others by "compress"
COMPRESS_ROPE_TYPES = ("default", "yarn")
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}


@dataclass
class DeepseekV4ModelConfig(MoEModelConfig):
    """DeepSeek-V4: every layer's residual is ``hc_mult`` streams mixed by hyper-connections
    (``hc_sinkhorn_iters``, ``hc_eps``); attention per ``layer_types`` (sliding window only, compressed
    sparse or heavily compressed, ``compress_rates`` per kind) with a low-rank query (``q_lora_rank``),
    one shared key/value head of ``head_dim``, RoPE on its last ``partial_rotary_factor`` share
    (``rope_theta`` for sliding layers, ``compress_rope_theta`` and ``rope_scaling`` for the others), a
    grouped output projection (``o_groups`` of ``o_lora_rank``) and a lightning indexer (``index_*``) in
    the compressed sparse layers. Every layer is an MoE layer (config.json ``n_routed_experts``,
    ``moe_intermediate_size``, ``n_shared_experts``), routed per ``mlp_layer_types``: ``moe`` by
    ``scoring_func`` (``moe_router``) top-k with a correction bias, ``hash_moe`` by a fixed table of the
    token id; routed and shared experts apply the clamped SwiGLU of ``swiglu_limit``.
    ``num_nextn_predict_layers`` is read and written back but not built (as transformers)."""

    HF_KEYS: ClassVar[dict[str, str]] = {
        **MoEModelConfig.HF_KEYS,
        "n_routed_experts": "num_experts",
        "moe_intermediate_size": "moe_ffn_hidden_size",
        "n_shared_experts": "moe_shared_experts",
        "scoring_func": "moe_router",
        **{
            key: key
            for key in (
                "head_dim",
                "q_lora_rank",
                "o_groups",
                "o_lora_rank",
                "sliding_window",
                "layer_types",
                "mlp_layer_types",
                "compress_rates",
                "compress_rope_theta",
                "hc_mult",
                "hc_sinkhorn_iters",
                "hc_eps",
                "index_n_heads",
                "index_head_dim",
                "index_topk",
                "swiglu_limit",
                "norm_topk_prob",
                "routed_scaling_factor",
                "partial_rotary_factor",
                "qk_rope_head_dim",
                "num_nextn_predict_layers",
            )
        },
    }
    HF_INERT_KEYS: ClassVar[dict[str, object]] = {
        **{k: v for k, v in MoEModelConfig.HF_INERT_KEYS.items() if k != "sliding_window"},
        "mlp_bias": False,
    }

    type: str = "deepseek_v4"
    moe_router: str = field(default="sqrtsoftplus", metadata={"architecture": True, "choices": V4_ROUTER_SCORES})
    head_dim: int = field(default=512, metadata={"shape": True})
    q_lora_rank: int = field(default=1024, metadata={"shape": True})
    o_groups: int = field(default=8, metadata={"shape": True})
    o_lora_rank: int = field(default=1024, metadata={"shape": True})
    sliding_window: int = field(default=128, metadata={"architecture": True})
    layer_types: Optional[list] = field(default=None, metadata={"shape": True})
    mlp_layer_types: Optional[list] = field(default=None, metadata={"shape": True})
    compress_rates: Optional[dict] = field(default=None, metadata={"shape": True})
    compress_rope_theta: float = field(default=160000.0, metadata={"architecture": True})
    hc_mult: int = field(default=4, metadata={"shape": True})
    hc_sinkhorn_iters: int = field(default=20, metadata={"architecture": True})
    hc_eps: float = field(default=1e-6, metadata={"architecture": True})
    index_n_heads: int = field(default=64, metadata={"shape": True})
    index_head_dim: int = field(default=128, metadata={"shape": True})
    index_topk: int = field(default=512, metadata={"architecture": True})
    swiglu_limit: float = field(default=10.0, metadata={"architecture": True})
    norm_topk_prob: bool = field(default=True, metadata={"architecture": True})
    routed_scaling_factor: float = field(default=1.5, metadata={"architecture": True})
    partial_rotary_factor: float = field(default=0.125, metadata={"shape": True})
    qk_rope_head_dim: Optional[int] = None  # what transformers writes beside partial_rotary_factor: checked
    num_nextn_predict_layers: int = 0  # the checkpoint's MTP depths: not built (as transformers)

    @property
    def stage_hidden_size(self) -> int:
        """Pipeline stages pass the ``hc_mult`` residual streams, flattened: ``hc_mult · hidden_size``."""
        return self.hc_mult * self.hidden_size


def v4_layer_types(cfg: ModelConfig) -> list[str]:
    """Each layer's attention kind: ``layer_types``, or transformers' default (two heavily compressed
    layers, then compressed sparse and heavily compressed alternating)."""
    if cfg.layer_types is not None:
        return list(cfg.layer_types)
    n = cfg.num_layers
    return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]


def v4_mlp_layer_types(cfg: ModelConfig) -> list[str]:
    """Each layer's routing: ``mlp_layer_types``, or transformers' default (three hash-routed, then top-k)."""
    if cfg.mlp_layer_types is not None:
        return list(cfg.mlp_layer_types)
    return [HASH_MOE] * min(cfg.num_layers, 3) + [MOE] * max(cfg.num_layers - 3, 0)


def v4_compress_rates(cfg: ModelConfig) -> dict[str, int]:
    """The compression rate of each compressed attention kind (transformers' defaults where unset)."""
    return {**DEFAULT_COMPRESS_RATES, **(cfg.compress_rates or {})}


def rope_head_dim(cfg: ModelConfig) -> int:
    """How many of each head's dims RoPE turns: ``head_dim · partial_rotary_factor``."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def check_deepseek_v4_keys(cfg: ModelConfig, source: str) -> None:
    """Refuse, naming the key and value, what megacann's deepseek_v4 does not implement (unknown layer or
    routing kinds, lists of the wrong length, rotary scalings other than YaRN) or what cannot be built."""
    check_layer_types(cfg.layer_types, cfg.num_layers, ATTENTION_TYPES, "deepseek_v4", "attention kind", source)
    mlp = cfg.mlp_layer_types
    if mlp is not None and (not isinstance(mlp, list) or len(mlp) != cfg.num_layers):
        raise ConfigError(
            f"{source}: mlp_layer_types must list one routing kind per layer ({cfg.num_layers}), got {mlp!r}"
        )
    for i, kind in enumerate(mlp or []):
        if kind not in MLP_TYPES:
            raise ConfigError(
                f"{source}: mlp_layer_types[{i}] {kind!r} is not implemented by megacann's deepseek_v4 "
                f"(expected one of {MLP_TYPES})"
            )
    if cfg.moe_router not in V4_ROUTER_SCORES:
        raise ConfigError(
            f"{source}: scoring_func (model.moe_router) {cfg.moe_router!r} is not implemented by megacann's "
            f"deepseek_v4 (expected one of {V4_ROUTER_SCORES})"
        )
    for kind, rate in (cfg.compress_rates or {}).items():
        if kind not in (CSA, HCA) or isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
            raise ConfigError(
                f"{source}: compress_rates {{{kind!r}: {rate!r}}} is refused (keys {CSA!r} / {HCA!r}, positive integers)"
            )
    rope = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type", "default"))
    if rope not in COMPRESS_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope_parameters.compress.rope_type {rope!r} is not implemented by megacann's deepseek_v4 "
            f"(expected one of {COMPRESS_ROPE_TYPES})"
        )
    width = rope_head_dim(cfg)
    if width < 2 or width % 2 or width > cfg.head_dim:
        raise ConfigError(
            f"{source}: partial_rotary_factor {cfg.partial_rotary_factor} of head_dim {cfg.head_dim} gives {width} "
            "rotated dims: an even number in [2, head_dim] is needed"
        )
    if cfg.qk_rope_head_dim is not None and cfg.qk_rope_head_dim != width:
        raise ConfigError(
            f"{source}: qk_rope_head_dim {cfg.qk_rope_head_dim} disagrees with head_dim x partial_rotary_factor {width}"
        )
    for key in ("hc_mult", "hc_sinkhorn_iters", "sliding_window", "o_groups", "o_lora_rank", "q_lora_rank"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{source}: {key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.swiglu_limit <= 0:
        raise ConfigError(f"{source}: swiglu_limit must be > 0, got {cfg.swiglu_limit}")
    if cfg.num_key_value_heads not in (None, 1):
        raise ConfigError(
            f"{source}: num_key_value_heads {cfg.num_key_value_heads} is refused: DeepSeek-V4 reads one shared "
            "key/value head"
        )
    if (cfg.num_attention_heads * cfg.head_dim) % cfg.o_groups:
        raise ConfigError(
            f"{source}: o_groups {cfg.o_groups} must divide num_attention_heads x head_dim "
            f"{cfg.num_attention_heads * cfg.head_dim}"
        )
    if cfg.add_bias_linear:
        raise ConfigError(
            f"{source}: attention_bias (model.add_bias_linear) true is refused: DeepSeek-V4 has no biases"
        )
    if cfg.moe_shared_experts != 1:
        raise ConfigError(
            f"{source}: n_shared_experts (model.moe_shared_experts) {cfg.moe_shared_experts} is refused: DeepSeek-V4 "
            "has one shared expert of moe_intermediate_size"
        )
    if not cfg.norm_topk_prob or cfg.moe_top_k < 2:
        raise ConfigError(
            f"{source}: norm_topk_prob {cfg.norm_topk_prob} with num_experts_per_tok {cfg.moe_top_k} is refused: "
            "DeepSeek-V4 always renormalises the chosen experts' weights, which needs true and at least 2"
        )
