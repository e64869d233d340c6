"""Qwen3.5 and Qwen3.5-MoE (``model.type: qwen3_5``, ``qwen3_5_moe``) on one process (CPU, fp32):
transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM logits both ways (from_pretrained_hf,
save_pretrained_hf, megacann-convert from-hf / to-hf), the gated attention and partial rotary against the
formula written here, what the families refuse, and the parameter counts of the built models and of
transformers' default configurations against transformers' models on the meta device."""

from __future__ import annotations

import json
import math

import pytest
import torch
from published_config_checks import check_recipe_matches_published
from qwen3_5_helpers import SHAPE, check_hf_round_trips, hf_classes, hf_logits, tiny_hf_qwen3_5
from training_helpers import tiny_config

from megacann.config import ConfigError
from megacann.interop import from_pretrained_hf
from megacann.layers import SelfAttention
from megacann.layers.sharding import get_sharding
from megacann.models import ChunkPlacement, get_model_spec

pytest.importorskip("transformers")
IDS = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))


def test_gated_attention_with_partial_rotary_equals_the_formula():
    torch.manual_seed(0)
    b, s, h, heads, d, rot = 2, 6, 32, 2, 8, 4
    attn = SelfAttention(h, heads, head_dim=d, output_gate=True)
    x = torch.randn(b, s, h)
    angles = torch.arange(s).float()[:, None] * torch.tensor([1.0, 0.1])  # two frequencies: 4 rotary dims
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    qg = (x @ attn.q_proj.weight.t()).view(b, s, heads, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k, v = ((x @ w.t()).view(b, s, heads, d) for w in (attn.k_proj.weight, attn.v_proj.weight))

    def rope(t):  # the first 4 dims turned in pairs (i, i + 2), the other 4 as they are
        r, rest = t[..., :rot], t[..., rot:]
        half = torch.cat([-r[..., rot // 2 :], r[..., : rot // 2]], -1)
        return torch.cat([r * cos[:, None] + half * sin[:, None], rest], -1)

    scores = torch.einsum("bqhd,bkhd->bhqk", rope(q), rope(k)) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    heads_out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v) * torch.sigmoid(gate)
    expected = heads_out.flatten(2) @ attn.o_proj.weight.t()
    with torch.no_grad():
        torch.testing.assert_close(attn(x, (cos, sin)), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"output_gate needs fused_qkv=False"):
        SelfAttention(h, heads, head_dim=d, output_gate=True, fused_qkv=True)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_hf_logits_parity_both_ways_and_through_convert(tmp_path, moe):
    hf_dir = tiny_hf_qwen3_5(str(tmp_path / "hf"), moe=moe)
    expected = hf_logits(hf_dir, IDS, moe)
    ours = from_pretrained_hf(hf_dir).eval()
    assert ours.config.type == ("qwen3_5_moe" if moe else "qwen3_5") and ours.rotary.head_dim == 4  # 16 / 4
    kinds = [type(block.self_attn).__name__ for block in ours.layers.values()]
    assert kinds == ["LinearAttentionMixer", "LinearAttentionMixer", "SelfAttention", "LinearAttentionMixer"]
    assert ours.layers["2"].self_attn.q_proj.weight.shape == (2 * 4 * 16, 64)  # queries and gates
    if moe:  # 4 experts of width 32, a shared expert of 48 with its gate row
        mlp = ours.layers["0"].mlp
        assert sorted(mlp.experts) == ["0", "1", "2", "3"] and mlp.config.normalize_top_k
        assert mlp.experts["0"].gate_up_proj.weight.shape == (64, 64)
        assert mlp.shared_experts.expert.gate_up_proj.weight.shape == (96, 64)
        assert mlp.shared_experts.gate_weight.shape == (1, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=IDS), expected, atol=1e-4, rtol=0)
    assert expected.std() > 0.5  # logits that differ enough to tell a mix-up

    check_hf_round_trips(ours, hf_dir, tmp_path, IDS, expected, hf_classes(moe)[1])


# -- what the family refuses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,message",
    [
        ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]},
         r"layer_types\[1\] 'sliding_attention' is not implemented by megacann's qwen3_5"),
        ({"layer_types": ["full_attention"]}, r"layer_types must list one token mixer per layer \(4\)"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                              "original_max_position_embeddings": 32, "partial_rotary_factor": 0.25}},
         r"rope_type 'yarn' is not implemented by megacann's qwen3_5"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
         r"partial_rotary_factor 0.1 gives 1 rotary dims of head_dim 16"),
        ({"linear_num_value_heads": 3}, r"linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
        ({"attention_bias": True}, r"attention_bias \(model.add_bias_linear\) true is refused: Qwen3.5 has no biases"),
    ],
)  # fmt: skip
def test_config_json_the_family_does_not_implement_is_refused_naming_key_and_value(tmp_path, change, message):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3_5_text", **SHAPE, **change}))
    with pytest.raises(ConfigError, match=message):
        get_model_spec("qwen3_5").hf.config_from_hf(str(config))


def test_recipe_refusals_name_the_key():
    with pytest.raises(ConfigError, match=r"moe_shared_experts 1 .* Qwen3.5-MoE has an MoE layer in every layer"):
        tiny_config([*QWEN3_5_MOE, "model.moe_shared_experts=1"])
    with pytest.raises(ConfigError, match=r"linear_num_key_heads 3 is not divisible by .*tensor_parallel_size 2"):
        tiny_config(
            [*QWEN3_5, "model.linear_num_key_heads=3", "model.linear_num_value_heads=6"]
            + ["distributed.tensor_parallel_size=2"],
            world_size=2,
        )


# -- sizes ---------------------------------------------------------------------------------------------

QWEN3_5 = ["model.type=qwen3_5", "model.head_dim=16", "model.linear_num_key_heads=2", "model.linear_num_value_heads=4"]
QWEN3_5 += ["model.linear_key_head_dim=8", "model.linear_value_head_dim=8"]


QWEN3_5_MOE = [*QWEN3_5, "model.type=qwen3_5_moe", "model.num_experts=4", "model.moe_ffn_hidden_size=32"]
QWEN3_5_MOE += ["model.shared_expert_intermediate_size=48"]


@pytest.mark.parametrize("overrides", [QWEN3_5, QWEN3_5_MOE], ids=["qwen3_5", "qwen3_5_moe"])
def test_parameter_formulas_count_the_built_model(overrides):
    cfg = tiny_config(overrides)
    spec = get_model_spec(cfg.model.type)
    with torch.device("meta"):
        model = spec.build(cfg, ChunkPlacement(tuple(range(cfg.model.num_layers))), "meta")
    total = sum(math.prod(get_sharding(p).logical_shape) for p in model.parameters())  # vocabulary unpadded
    assert spec.total_parameters(cfg.model) == total
    m = cfg.model
    idle = m.num_layers * (m.num_experts - m.moe_top_k) * 3 * 64 * 32 if m.type == "qwen3_5_moe" else 0
    assert spec.parameters_per_token(m) == total - idle


# transformers' Qwen3_5TextConfig() defaults (documented as "Qwen3.5-9B style"), as config.json names them
DEFAULT_CONFIG = {
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}  # fmt: skip
EXPECTED_DEFAULT = 8_953_803_264  # transformers' count below


def test_default_size_recipe_counts_what_transformers_counts(tmp_path):
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**DEFAULT_CONFIG))
    total = sum(p.numel() for p in model.parameters())
    assert total == EXPECTED_DEFAULT
    cfg, from_hf = check_recipe_matches_published(tmp_path, "qwen3_5/qwen3_5_9b.yaml", DEFAULT_CONFIG, total, total)
    assert from_hf.partial_rotary_factor == cfg.model.partial_rotary_factor == 0.25
    assert from_hf.layer_types is None and cfg.model.rope_theta == from_hf.rope_theta


# transformers' Qwen3_5MoeTextConfig() defaults (documented as "Qwen3.5-35B-A3B style")
DEFAULT_MOE_CONFIG = {
    **{k: v for k, v in DEFAULT_CONFIG.items() if k not in ("intermediate_size", "num_hidden_layers", "hidden_size")},
    "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "router_aux_loss_coef": 0.001,
}  # fmt: skip
EXPECTED_DEFAULT_MOE = (34_660_610_688, 3_454_988_928)  # transformers' count below: total, active per token


def test_default_moe_size_recipe_counts_what_transformers_counts(tmp_path):
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**DEFAULT_MOE_CONFIG))
    total = sum(p.numel() for p in model.parameters())
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    per_expert = sum(p.numel() for e in experts for p in e.parameters()) // (len(experts) * 256)
    active = total - len(experts) * (256 - 8) * per_expert
    assert (total, active) == EXPECTED_DEFAULT_MOE
    recipe = "qwen3_5/qwen3_5_moe_35b_a3b.yaml"
    cfg, from_hf = check_recipe_matches_published(tmp_path, recipe, DEFAULT_MOE_CONFIG, total, active)
    assert from_hf.shared_expert_intermediate_size == cfg.model.shared_expert_intermediate_size == 512
