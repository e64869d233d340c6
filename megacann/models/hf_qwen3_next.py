"""The Hugging Face adapter of Qwen3-Next: ``Qwen3NextForCausalLM`` (``model_type: qwen3_next``) both ways.

Everything maps as Qwen3.5-MoE's (:mod:`megacann.models.hf_qwen3_5_moe`; the dense layers of
``mlp_only_layers`` as LLaMA's MLP) except the Gated DeltaNet's input projections. Hugging Face fuses them
into two matrices whose rows are grouped by key head ``g`` (``r`` = value heads per key head)::

    linear_attn.in_proj_qkvz.weight  per g: q_g (key width), k_g (key width), v_g (r value heads), z_g (r value heads)
    linear_attn.in_proj_ba.weight    per g: b_g (r rows), a_g (r rows)

megacann's :class:`~megacann.layers.GatedDeltaNet` holds ``in_proj_qkv`` (all q, all k, all v), ``in_proj_z``,
``in_proj_b`` and ``in_proj_a``: the same rows, regrouped (value head ``g·r + j`` is the ``j``-th of key head
``g`` on both sides), so the conversion is exact both ways.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Optional

import torch

from megacann.config import ConfigError, ModelConfig
from megacann.config.hf_config import read_hf_config
from megacann.models import hf_llama, hf_qwen3_5, hf_qwen3_5_moe
from megacann.models.hf_qwen3_5 import Reader
from megacann.models.qwen3_5_config import check_qwen3_5_keys
from megacann.models.qwen3_next_config import FULL_ATTENTION_INTERVAL_KEY, layer_types_from_interval
from megacann.models.qwen_config import qwen3_moe_layer_flags
from megacann.models.sizing import attention_head_dim
from megacann.models.spec import HFAdapter

_SPLIT = re.compile(r"^(.*\.linear_attn\.)in_proj_(qkv|z|b|a)\.weight$")  # megacann's four, by Hugging Face name


def _qkvz_widths(cfg: ModelConfig) -> list[int]:
    """Rows of q, k, v, z per key head."""
    values = cfg.linear_num_value_heads // cfg.linear_num_key_heads * cfg.linear_value_head_dim
    return [cfg.linear_key_head_dim, cfg.linear_key_head_dim, values, values]


def _ba_widths(cfg: ModelConfig) -> list[int]:
    """Rows of b, a per key head."""
    return [cfg.linear_num_value_heads // cfg.linear_num_key_heads] * 2


def _group_by_key_head(parts: Sequence[torch.Tensor], key_heads: int) -> torch.Tensor:
    """One matrix whose rows are, per key head, that head's rows of each part in turn."""
    grouped = [part.reshape(key_heads, -1, part.shape[-1]) for part in parts]
    return torch.cat(grouped, dim=1).reshape(-1, parts[0].shape[-1])


def _ungroup_by_key_head(fused: torch.Tensor, widths: list[int], key_heads: int) -> list[torch.Tensor]:
    """The parts of a matrix grouped by key head (:func:`_group_by_key_head` undone)."""
    pieces = fused.reshape(key_heads, sum(widths), fused.shape[-1]).split(widths, dim=1)
    return [piece.reshape(-1, fused.shape[-1]) for piece in pieces]


def _fused_names(prefix: str) -> tuple[str, str]:
    return f"{prefix}in_proj_qkvz.weight", f"{prefix}in_proj_ba.weight"


def _qkv_rows(cfg: ModelConfig) -> list[int]:
    """Rows of q, k and v in megacann's ``in_proj_qkv``."""
    keys = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    return [keys, keys, cfg.linear_num_value_heads * cfg.linear_value_head_dim]


def to_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megacann whole tensors -> Hugging Face names, each DeltaNet's projections fused per key head."""
    out = hf_qwen3_5_moe.to_hf_tensors(tensors, cfg)
    heads = cfg.linear_num_key_heads
    for prefix in sorted({match.group(1) for name in out if (match := _SPLIT.match(name))}):
        q, k, v = out.pop(f"{prefix}in_proj_qkv.weight").split(_qkv_rows(cfg))
        z, b, a = (out.pop(f"{prefix}in_proj_{part}.weight") for part in ("z", "b", "a"))
        qkvz, ba = _fused_names(prefix)
        out[qkvz] = _group_by_key_head([q, k, v, z], heads).contiguous()
        out[ba] = _group_by_key_head([b, a], heads).contiguous()
    return out


def _split_reader(read: Reader, cfg: ModelConfig) -> Reader:
    """``read`` that also answers megacann's four DeltaNet projections, cut from the fused matrices."""

    def read_split(name: str) -> torch.Tensor:
        match = _SPLIT.match(name)
        if match is None:
            return read(name)
        qkvz, ba = _fused_names(match.group(1))
        heads = cfg.linear_num_key_heads
        if match.group(2) in ("b", "a"):
            b, a = _ungroup_by_key_head(read(ba), _ba_widths(cfg), heads)
            return b if match.group(2) == "b" else a
        q, k, v, z = _ungroup_by_key_head(read(qkvz), _qkvz_widths(cfg), heads)
        return z if match.group(2) == "z" else torch.cat([q, k, v], dim=0)

    return read_split


def from_hf_tensors(names: Sequence[str], read: Reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole tensors of megacann ``names``, read by Hugging Face name (the fused projections cut)."""
    return hf_qwen3_5_moe.from_hf_tensors(names, _split_reader(read, cfg), cfg)


def linear_parts(name: str, cfg: ModelConfig) -> list[tuple[str, Optional[int]]]:
    """The Hugging Face names of a megacann linear weight (PEFT adapter names): a DeltaNet's in_proj_qkv and
    in_proj_z live in ``in_proj_qkvz``, its in_proj_b and in_proj_a in ``in_proj_ba``."""
    parts = hf_qwen3_5_moe.linear_parts(name, cfg)
    match = _SPLIT.match(parts[0][0].removeprefix("model."))
    if match is None:
        return parts
    qkvz, ba = _fused_names("model." + match.group(1))
    return [(ba if match.group(2) in ("b", "a") else qkvz, None)]


def lora_b_to_hf(name: str, b: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A LoRA's ``B`` on megacann's DeltaNet projection ``name`` laid out on the rows of Hugging Face's fused
    one, regrouped per key head as the weight's rows are, with zero rows for the projections it leaves
    alone (``B`` as it is for any other weight)."""
    match = _SPLIT.match(hf_qwen3_5.linear_parts(name, cfg)[0][0].removeprefix("model."))
    if match is None:
        return b
    part, heads = match.group(2), cfg.linear_num_key_heads
    if part in ("b", "a"):
        zero = b.new_zeros(b.shape)
        return _group_by_key_head([b, zero] if part == "b" else [zero, b], heads)
    qkv_rows = _qkv_rows(cfg)
    qkv = b.split(qkv_rows) if part == "qkv" else [b.new_zeros(rows, b.shape[1]) for rows in qkv_rows]
    z = b if part == "z" else b.new_zeros(cfg.linear_num_value_heads * cfg.linear_value_head_dim, b.shape[1])
    return _group_by_key_head([*qkv, z], heads)


_SHARING_A = (("in_proj_qkv", "in_proj_z"), ("in_proj_b", "in_proj_a"))  # each pair is one module in transformers


def peft_refusal(targets: Sequence[str]) -> Optional[str]:
    """Why PEFT cannot hold these targets: the MLPs' (as Qwen3.5-MoE's), or both projections of one Hugging
    Face DeltaNet module (its one LoRA has one ``A``; megacann's two projections would have two). None
    when it can."""
    both = [pair for pair in _SHARING_A if all(t in targets for t in pair)]
    if not both:
        return hf_qwen3_5_moe.peft_refusal(targets)
    named = ", ".join(f"{p} + {q}" for p, q in both)
    return (
        f"{named} are refused for qwen3_next: transformers fuses each pair into one projection (in_proj_qkvz, "
        "in_proj_ba), whose PEFT LoRA shares one A that megacann's separate projections do not; target one of "
        "each pair"
    )


def qwen3_next_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a ``Qwen3NextForCausalLM``: Qwen3.5-MoE's keys, the dense layers' width and Qwen3-MoE's
    choice of MoE layers."""
    config = hf_qwen3_5_moe.qwen3_5_moe_config_dict(cfg, dtype)
    config.update(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        intermediate_size=cfg.ffn_size,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers),
    )
    return config


def qwen3_next_config_from_hf(config_file: str, raw: Optional[dict[str, Any]] = None) -> ModelConfig:
    """A qwen3_next ModelConfig from config.json (``full_attention_interval`` read as transformers does; what
    Qwen3.5 refuses refused here too), its MoE layers derived."""
    raw = read_hf_config(config_file) if raw is None else raw
    layer_types = layer_types_from_interval(raw, config_file)
    raw = {key: value for key, value in raw.items() if key != FULL_ATTENTION_INTERVAL_KEY}
    if layer_types is not None:
        raw["layer_types"] = layer_types
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(
            f"{config_file}: hidden_act {act!r} is not implemented by megacann's qwen3_next (expected silu)"
        )
    cfg = hf_llama.model_config_from_hf(config_file, family="qwen3_next", raw=raw)
    for key, field_name in (("num_experts", "num_experts"), ("moe_intermediate_size", "moe_ffn_hidden_size")):
        if not getattr(cfg, field_name):
            raise ConfigError(f"{config_file}: {key} {getattr(cfg, field_name)!r}: a Qwen3-Next model needs experts")
    check_qwen3_5_keys(cfg, config_file, attention_head_dim(cfg))
    if cfg.decoder_sparse_step >= 1 and cfg.num_layers:
        cfg.moe_layer_freq = qwen3_moe_layer_flags(cfg)
    return cfg


QWEN3_NEXT_HF = HFAdapter(
    model_types=("qwen3_next",),
    config_from_hf=qwen3_next_config_from_hf,
    config_to_hf=qwen3_next_config_dict,
    to_hf=to_hf_tensors,
    from_hf=from_hf_tensors,
    linear_parts=linear_parts,
    lora_b_to_hf=lora_b_to_hf,
    peft_refusal=peft_refusal,
)
