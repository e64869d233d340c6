"""Qwen3-Next (``model.type: qwen3_next``) on one process (CPU, fp32): transformers' Qwen3NextForCausalLM
logits both ways (from_pretrained_hf, save_pretrained_hf, megacann-convert from-hf / to-hf) with dense and
MoE layers mixed by ``mlp_only_layers`` / ``decoder_sparse_step``, the DeltaNet projections Hugging Face
fuses per key head against the rows written out here, what the family refuses, and the parameter counts
of the built model and of transformers' default configuration against transformers' model on the meta
device."""

from __future__ import annotations

import json
import math

import pytest
import torch
from published_config_checks import check_recipe_matches_published
from qwen3_5_helpers import check_hf_round_trips
from qwen3_next_helpers import SHAPE, hf_classes, hf_next_logits, tiny_hf_qwen3_next
from training_helpers import tiny_config

from megacann.config import ConfigError
from megacann.interop import from_pretrained_hf
from megacann.layers.sharding import get_sharding
from megacann.models import ChunkPlacement, get_model_spec

pytest.importorskip("transformers")
IDS = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
MIXERS = ["LinearAttentionMixer", "LinearAttentionMixer", "SelfAttention", "LinearAttentionMixer"]
# (settings, each layer's feed-forward kind, renormalised top-k)
VARIANTS = {
    "mlp_only_layers": ({}, ["MoELayer", "SwiGLUMLP", "MoELayer", "MoELayer"], True),
    "sparse_step_2": (
        {"mlp_only_layers": [], "decoder_sparse_step": 2, "norm_topk_prob": False},
        ["SwiGLUMLP", "MoELayer", "SwiGLUMLP", "MoELayer"],
        False,
    ),
}


def _fused_rows_by_hand(model, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's in_proj_qkvz / in_proj_ba of a megacann DeltaNet, written row block by row block:
    per key head g its q, k rows, then the v and z rows of its two value heads 2g and 2g + 1 (b, a alike)."""
    mixer = model.layers[layer].self_attn
    dk, dv = SHAPE["linear_key_head_dim"], SHAPE["linear_value_head_dim"]
    keys = SHAPE["linear_num_key_heads"] * dk
    qkv, z = mixer.in_proj_qkv.weight, mixer.in_proj_z.weight
    b, a = mixer.in_proj_b.weight, mixer.in_proj_a.weight
    qkvz, ba = [], []
    for g in range(SHAPE["linear_num_key_heads"]):
        values = slice(2 * g * dv, (2 * g + 2) * dv)
        qkvz += [
            qkv[g * dk : (g + 1) * dk],
            qkv[keys + g * dk : keys + (g + 1) * dk],
            qkv[2 * keys :][values],
            z[values],
        ]
        ba += [b[2 * g : 2 * g + 2], a[2 * g : 2 * g + 2]]
    return torch.cat(qkvz), torch.cat(ba)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_logits_parity_both_ways_and_through_convert(tmp_path, variant):
    settings, mlps, renormalised = VARIANTS[variant]
    hf_dir = tiny_hf_qwen3_next(str(tmp_path / "hf"), **settings)
    expected = hf_next_logits(hf_dir, IDS)
    ours = from_pretrained_hf(hf_dir).eval()
    assert ours.config.type == "qwen3_next" and ours.rotary.head_dim == 4  # 16 / 4
    assert [type(block.self_attn).__name__ for block in ours.layers.values()] == MIXERS
    assert [type(block.mlp).__name__ for block in ours.layers.values()] == mlps
    moe = next(block.mlp for block in ours.layers.values() if type(block.mlp).__name__ == "MoELayer")
    assert moe.config.normalize_top_k is renormalised and sorted(moe.experts) == ["0", "1", "2", "3"]
    shared = moe.shared_experts
    assert shared.expert.gate_up_proj.weight.shape == (96, 64) and shared.gate_weight.shape == (1, 64)
    dense = next(block.mlp for block in ours.layers.values() if type(block.mlp).__name__ == "SwiGLUMLP")
    assert dense.gate_up_proj.weight.shape == (80, 64)  # intermediate_size 40
    hf_state = hf_classes()[1].from_pretrained(hf_dir).state_dict()
    qkvz, ba = _fused_rows_by_hand(ours, "3")
    assert torch.equal(qkvz, hf_state["model.layers.3.linear_attn.in_proj_qkvz.weight"])
    assert torch.equal(ba, hf_state["model.layers.3.linear_attn.in_proj_ba.weight"])
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=IDS), expected, atol=1e-4, rtol=0)
    assert expected.std() > 0.5  # logits that differ enough to tell a mix-up

    check_hf_round_trips(ours, hf_dir, tmp_path, IDS, expected, hf_classes()[1])


# -- config.json ---------------------------------------------------------------------------------------


def _write(tmp_path, raw: dict) -> str:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3_next", **raw}))
    return str(config)


def test_full_attention_interval_gives_the_layers_transformers_gives(tmp_path):
    raw = {**{k: v for k, v in SHAPE.items() if k != "layer_types"}, "full_attention_interval": 2}
    cfg = get_model_spec("qwen3_next").hf.config_from_hf(_write(tmp_path, raw))
    assert cfg.layer_types == hf_classes()[0](**raw).layer_types == ["linear_attention", "full_attention"] * 2


@pytest.mark.parametrize(
    "change,message",
    [
        ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]},
         r"layer_types\[1\] 'sliding_attention' is not implemented by megacann's"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not implemented by megacann's qwen3_next \(expected silu\)"),
        ({"num_experts": 0}, r"num_experts 0: a Qwen3-Next model needs experts"),
        ({"layer_types": None, "full_attention_interval": 0}, r"full_attention_interval must be a positive integer, got 0"),
        ({"linear_num_value_heads": 3}, r"linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    ],
)  # fmt: skip
def test_config_json_the_family_does_not_implement_is_refused_naming_key_and_value(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        get_model_spec("qwen3_next").hf.config_from_hf(_write(tmp_path, {**SHAPE, **change}))


QWEN3_NEXT = ["model.type=qwen3_next", "model.head_dim=16", "model.linear_num_key_heads=2"]
QWEN3_NEXT += ["model.linear_num_value_heads=4", "model.linear_key_head_dim=8", "model.linear_value_head_dim=8"]
QWEN3_NEXT += ["model.num_experts=4", "model.moe_ffn_hidden_size=32", "model.shared_expert_intermediate_size=48"]
QWEN3_NEXT += ["model.mlp_only_layers=[0]"]


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.moe_bias_update_rate=0.001", r"moe_bias_update_rate 0.001 is refused: Qwen3-Next's router has no"),
        ("model.moe_shared_experts=1", r"moe_shared_experts 1 / moe_router 'softmax'"),
        ("model.mlp_only_layers=[7]", r"mlp_only_layers \[7\] are not layer indices in \[0, 4\)"),
    ],
)
def test_recipe_refusals_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config([*QWEN3_NEXT, override])


# -- sizes ---------------------------------------------------------------------------------------------


def test_parameter_formulas_count_the_built_model():
    cfg = tiny_config(QWEN3_NEXT)
    spec = get_model_spec(cfg.model.type)
    with torch.device("meta"):
        model = spec.build(cfg, ChunkPlacement(tuple(range(cfg.model.num_layers))), "meta")
    assert [type(block.mlp).__name__ for block in model.layers.values()] == ["SwiGLUMLP"] + ["MoELayer"] * 3
    total = sum(math.prod(get_sharding(p).logical_shape) for p in model.parameters())  # vocabulary unpadded
    assert spec.total_parameters(cfg.model) == total
    idle = 3 * (4 - cfg.model.moe_top_k) * 3 * 64 * 32  # the MoE layers' experts a token does not meet
    assert spec.parameters_per_token(cfg.model) == total - idle


# transformers' Qwen3NextConfig() defaults (documented as "Qwen3-Next-80B-A3B style"), as config.json names them
DEFAULT_CONFIG = {
    "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 151936, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}  # fmt: skip
EXPECTED_DEFAULT = (79_674_391_296, 3_874_929_408)  # transformers' count below: total, active per token


def test_default_size_recipe_counts_what_transformers_counts(tmp_path):
    import transformers

    config = transformers.Qwen3NextConfig(**DEFAULT_CONFIG)
    assert config.to_dict()["layer_types"] == transformers.Qwen3NextConfig().layer_types  # the defaults indeed
    with torch.device("meta"):
        model = transformers.Qwen3NextForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    per_expert = sum(p.numel() for e in experts for p in e.parameters()) // (len(experts) * 512)
    active = total - len(experts) * (512 - 10) * per_expert
    assert (total, active) == EXPECTED_DEFAULT
    cfg, from_hf = check_recipe_matches_published(
        tmp_path, "qwen3_next/qwen3_next_80b_a3b.yaml", DEFAULT_CONFIG, total, active
    )
    assert from_hf.norm_topk_prob is cfg.model.norm_topk_prob is True
    assert from_hf.moe_layer_freq == [1] * 48 and from_hf.ffn_hidden_size == cfg.model.ffn_hidden_size == 5632
