"""The Hugging Face adapter of DeepSeek-V4: ``DeepseekV4ForCausalLM`` checkpoints both ways.

transformers 5.25 writes (and reads) DeepSeek's own tensor names, which differ from its modules' names;
megacann's modules carry the module names (``layers.<i>.self_attn.q_a_proj``, ``attn_hc.fn``, ...), so this
adapter maps them onto the checkpoint's (``model.`` prefixed there)::

    embed_tokens.weight / norm.weight / hc_head.*          model.embed_tokens.weight / model.norm.weight / model.hc_head.*
    lm_head.weight                                         head.weight
    layers.<i>.input_layernorm / post_attention_layernorm  model.layers.<i>.attn_norm / ffn_norm
    layers.<i>.attn_hc.{fn,base,scale}                     model.layers.<i>.hc_attn_{fn,base,scale} (ffn_hc: hc_ffn_*)
    layers.<i>.self_attn.<module name>                     model.layers.<i>.attn.<DeepSeek's name> (q_a_proj -> wq_a,
        q_b_proj -> wq_b, kv_proj -> wkv, kv_norm -> norm, q_a_norm -> q_norm, o_a_proj / o_b_proj -> wo_a / wo_b,
        sinks -> attn_sink, gate_proj -> wgate, position_bias -> ape; compressor.indexer.* -> indexer.compressor.*,
        its q_b_proj -> indexer.wq_b, scorer.weights_proj -> indexer.weights_proj)
    layers.<i>.mlp.router.weight / expert_bias / token_to_experts    model.layers.<i>.ffn.gate.weight / bias / tid2eid
    layers.<i>.mlp.experts.<e>.gate_up_proj.weight         cat(model.layers.<i>.ffn.experts.<e>.w1, .w3) (down_proj: w2)
    layers.<i>.mlp.shared_experts.gate_up_proj.weight      cat(...ffn.shared_experts.w1, .w3) (down_proj: w2)

config.json keeps one set of rotary settings per kind, ``rope_parameters: {main, compress}``: ``main`` (plain
RoPE, ``rope_theta``) for the sliding-window layers, ``compress`` (``compress_rope_theta``, YaRN as
``rope_scaling``) for the compressed ones; both carry ``partial_rotary_factor``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from megacann.config import ConfigError, ModelConfig
from megacann.config.hf_config import load_hf_model_config, read_hf_config
from megacann.layers.lora.targets import MLP_PROJECTIONS
from megacann.models import hf_llama
from megacann.models.deepseek_v4_config import (
    ROPE_KINDS,
    DeepseekV4ModelConfig,
    check_deepseek_v4_keys,
    v4_compress_rates,
    v4_layer_types,
    v4_mlp_layer_types,
)
from megacann.models.hf_mixtral import ExpertLayout, experts_from_hf, experts_to_hf
from megacann.models.spec import HFAdapter

V4_LAYOUT = ExpertLayout("model.layers.{layer}.ffn")  # router gate, experts w1 (gate) / w3 (up) / w2 (down)
Reader = Callable[[str], torch.Tensor]
_ROUTED = re.compile(r"layers\.\d+\.mlp\.(router\.weight|experts\.\d+\.(gate_up_proj|down_proj)\.weight)")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_TOP = {"lm_head.weight": "head.weight"}
_BLOCK = {  # a layer's own tensors, megacann -> checkpoint (under model.layers.<i>.)
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{
        f"{hc}.{p}": f"hc_{short}_{p}"
        for hc, short in (("attn_hc", "attn"), ("ffn_hc", "ffn"))
        for p in ("fn", "base", "scale")
    },
    "mlp.router.expert_bias": "ffn.gate.bias",
    "mlp.router.token_to_experts": "ffn.gate.tid2eid",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
_SHARED_GATE_UP = "mlp.shared_experts.gate_up_proj.weight"
_ATTENTION_LEAVES = {
    "q_a_proj": "wq_a",
    "q_b_proj": "wq_b",
    "kv_proj": "wkv",
    "kv_norm": "norm",
    "q_a_norm": "q_norm",
    "o_a_proj": "wo_a",
    "o_b_proj": "wo_b",
    "sinks": "attn_sink",
    "gate_proj": "wgate",
    "position_bias": "ape",
}
_INDEXER_OWN = {
    "compressor.indexer.q_b_proj.": "indexer.wq_b.",
    "compressor.indexer.scorer.weights_proj.": "indexer.weights_proj.",
}
# transformers' DeepseekV4Config defaults of keys a config.json may leave out: config.json key -> (field, value)
HF_DEFAULTS = {
    "num_experts_per_tok": ("moe_top_k", 6),
    "n_shared_experts": ("moe_shared_experts", 1),
    "rms_norm_eps": ("norm_eps", 1e-6),
    "router_aux_loss_coef": ("moe_aux_loss_coeff", 0.001),
    "num_nextn_predict_layers": ("num_nextn_predict_layers", 1),
}


def _attention_name(rest: str) -> str:
    """A ``self_attn.`` weight's name in the checkpoint (after ``attn.``), from its module name."""
    for ours, theirs in _INDEXER_OWN.items():
        if rest.startswith(ours):
            return theirs + rest[len(ours) :]
    prefix = ""
    for ours, theirs in (("compressor.indexer.", "indexer.compressor."), ("compressor.", "compressor.")):
        if rest.startswith(ours):
            prefix, rest = theirs, rest[len(ours) :]
            break
    leaf, dot, tail = rest.partition(".")
    return prefix + _ATTENTION_LEAVES.get(leaf, leaf) + dot + tail


def checkpoint_parts(name: str) -> Optional[list[str]]:
    """The checkpoint names of megacann weight ``name`` (two for a fused gate/up projection, gate then up);
    None for the routed experts and routers, which :data:`V4_LAYOUT` maps."""
    if _ROUTED.fullmatch(name):
        return None
    if name in _TOP:
        return [_TOP[name]]
    match = _LAYER.fullmatch(name)
    if match is None:
        return ["model." + name]
    base, rest = f"model.layers.{match[1]}.", match[2]
    if rest == _SHARED_GATE_UP:
        return [base + "ffn.shared_experts.w1.weight", base + "ffn.shared_experts.w3.weight"]
    if rest in _BLOCK:
        return [base + _BLOCK[rest]]
    if rest.startswith("self_attn."):
        return [base + "attn." + _attention_name(rest[len("self_attn.") :])]
    raise ValueError(f"{name}: no DeepSeek-V4 checkpoint name is known for this weight")


def to_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megacann whole tensors -> the checkpoint's names (fused gate/up projections split)."""
    out: dict[str, torch.Tensor] = {}
    routed: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        parts = checkpoint_parts(name)
        if parts is None:
            routed[name] = tensor
        else:
            out.update(zip(parts, (piece.contiguous() for piece in tensor.chunk(len(parts), dim=0))))
    out.update(experts_to_hf(routed, cfg, V4_LAYOUT))
    return out


def from_hf_tensors(names: Sequence[str], read: Reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole tensors of megacann ``names``, read by checkpoint name through ``read(name)``."""
    out: dict[str, torch.Tensor] = {}
    routed = []
    for name in names:
        parts = checkpoint_parts(name)
        if parts is None:
            routed.append(name)
        else:
            out[name] = torch.cat([read(part) for part in parts]) if len(parts) > 1 else read(parts[0])
    out.update(experts_from_hf(routed, read, cfg, V4_LAYOUT))
    return out


def linear_parts(name: str, cfg: ModelConfig) -> list[tuple[str, Optional[int]]]:
    """The transformers module names (PEFT adapter names, not the checkpoint's) of a megacann linear weight:
    megacann's modules carry them, ``model.`` prefixed; a fused ``gate_up_proj`` is ``gate_proj`` then
    ``up_proj`` (the routed experts' per-expert names have no transformers module: see :func:`peft_refusal`)."""
    if not name.endswith(".gate_up_proj.weight"):
        return [("model." + name, None)]
    width = cfg.moe_ffn_hidden_size * (cfg.moe_shared_experts if ".shared_experts." in name else 1)
    return [("model." + name.replace("gate_up_proj", part), width) for part in ("gate_proj", "up_proj")]


def peft_refusal(targets: Sequence[str]) -> Optional[str]:
    """Why PEFT cannot hold LoRAs on those DeepSeek-V4 ``targets`` (None: it can): the grouped output
    projection's first half, and the MLP projections (which reach the stacked routed experts); both said
    when both are named."""
    reasons = []
    if "o_a_proj" in targets:
        reasons.append(
            "['o_a_proj'] is refused for deepseek_v4: transformers' o_a_proj is a grouped linear layer (each "
            "group of heads through its own block of rows), which PEFT's LoRA wraps as a plain linear layer of "
            "the wrong shape"
        )
    experts = [t for t in targets if t in MLP_PROJECTIONS]
    if experts:
        reasons.append(
            f"{experts} are refused for deepseek_v4: they reach every routed expert, which transformers stores "
            "stacked (DeepseekV4Experts, not linear modules PEFT's LoRA can adapt)"
        )
    advice = "target the attention projections (q_a_proj, q_b_proj, kv_proj, o_b_proj)"
    return "; ".join([*reasons, advice]) if reasons else None


def _read_rope(rope: dict[str, Any], cfg: ModelConfig, config_file: str) -> None:
    """``rope_parameters: {main, compress}`` onto ``rope_theta``, ``compress_rope_theta``, ``rope_scaling``
    (the compressed layers' YaRN) and ``partial_rotary_factor``; other kinds or a scaled main refused."""
    extra = sorted(set(rope) - set(ROPE_KINDS))
    if extra:
        raise ConfigError(f"{config_file}: rope_parameters.{extra[0]} is not a rotary kind of DeepSeek-V4 {ROPE_KINDS}")
    main, compress = dict(rope.get("main", {})), dict(rope.get("compress", {}))
    if main.get("rope_type", "default") != "default":
        raise ConfigError(
            f"{config_file}: rope_parameters.main.rope_type {main['rope_type']!r} is refused: DeepSeek-V4's sliding "
            "layers rotate by plain RoPE"
        )
    for part in (main, compress):
        if "partial_rotary_factor" in part:
            cfg.partial_rotary_factor = part.pop("partial_rotary_factor")
    cfg.rope_theta = main.get("rope_theta", cfg.rope_theta)
    cfg.compress_rope_theta = compress.pop("rope_theta", cfg.compress_rope_theta)
    kind = compress.get("rope_type", compress.get("type", "default"))
    cfg.rope_scaling = None if kind == "default" else compress


def _fold_legacy_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's older key names, as transformers folds them: ``num_hash_layers`` into ``mlp_layer_types``,
    ``compress_rate_csa`` / ``compress_rate_hca`` into ``compress_rates``."""
    raw = dict(raw)
    hash_layers = raw.pop("num_hash_layers", None)
    if hash_layers is not None and raw.get("mlp_layer_types") is None:
        n = raw.get("num_hidden_layers", 0)
        raw["mlp_layer_types"] = ["hash_moe"] * min(n, hash_layers) + ["moe"] * max(n - hash_layers, 0)
    for key, kind in (
        ("compress_rate_csa", "compressed_sparse_attention"),
        ("compress_rate_hca", "heavily_compressed_attention"),
    ):
        if key in raw:
            raw["compress_rates"] = {**(raw.get("compress_rates") or {}), kind: raw.pop(key)}
    return raw


def config_from_hf(config_file: str, raw: Optional[dict[str, Any]] = None) -> ModelConfig:
    """A deepseek_v4 ModelConfig from config.json; what megacann does not implement is refused naming the
    key and value (:func:`~megacann.models.deepseek_v4_config.check_deepseek_v4_keys`)."""
    raw = _fold_legacy_keys(read_hf_config(config_file) if raw is None else raw)
    rope = raw.pop("rope_parameters", None)
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{config_file}: hidden_act {raw['hidden_act']!r} is refused: DeepSeek-V4's experts use silu")
    values = load_hf_model_config(config_file, DeepseekV4ModelConfig, raw)
    cfg = DeepseekV4ModelConfig(**{**values, "type": "deepseek_v4", "precision": values.get("precision", "fp32")})
    cfg.add_bias_linear = bool(cfg.add_bias_linear)
    if cfg.num_experts is None or cfg.moe_ffn_hidden_size is None:
        raise ConfigError(f"{config_file}: n_routed_experts and moe_intermediate_size are needed for DeepSeek-V4")
    for key, (field, value) in HF_DEFAULTS.items():  # what transformers assumes where config.json is silent
        if key not in raw:
            setattr(cfg, field, value)
    if isinstance(rope, dict):
        _read_rope(rope, cfg, config_file)
    cfg.num_key_value_heads = raw.get("num_key_value_heads", 1)
    cfg.ffn_hidden_size = cfg.moe_ffn_hidden_size  # as the family fills it: no layer has a dense MLP
    check_deepseek_v4_keys(cfg, config_file)
    return cfg


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a ``DeepseekV4ForCausalLM`` with ``cfg``'s settings."""
    config = hf_llama.hf_config_dict(cfg, dtype)
    for key in ("rope_scaling", "intermediate_size"):
        config.pop(key)
    compress = {"rope_type": "default", **(cfg.rope_scaling or {})}
    factor = cfg.partial_rotary_factor
    config.update(
        architectures=["DeepseekV4ForCausalLM"],
        model_type="deepseek_v4",
        num_key_value_heads=1,
        head_dim=cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank,
        sliding_window=cfg.sliding_window,
        layer_types=v4_layer_types(cfg),
        mlp_layer_types=v4_mlp_layer_types(cfg),
        compress_rates=v4_compress_rates(cfg),
        compress_rope_theta=cfg.compress_rope_theta,
        hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
        hc_eps=cfg.hc_eps,
        index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        swiglu_limit=cfg.swiglu_limit,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        n_routed_experts=cfg.num_experts,
        n_shared_experts=cfg.moe_shared_experts,
        num_experts_per_tok=cfg.moe_top_k,
        scoring_func=cfg.moe_router,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        router_aux_loss_coef=cfg.moe_aux_loss_coeff,
        num_nextn_predict_layers=cfg.num_nextn_predict_layers,
        partial_rotary_factor=factor,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": factor},
            "compress": {**compress, "rope_theta": cfg.compress_rope_theta, "partial_rotary_factor": factor},
        },
    )
    return config


DEEPSEEK_V4_HF = HFAdapter(
    model_types=("deepseek_v4",),
    config_from_hf=config_from_hf,
    config_to_hf=hf_config_dict,
    to_hf=to_hf_tensors,
    from_hf=from_hf_tensors,
    linear_parts=linear_parts,
    checkpoint_buffers=lambda name: name.endswith(".mlp.router.token_to_experts"),
    peft_refusal=peft_refusal,
)
