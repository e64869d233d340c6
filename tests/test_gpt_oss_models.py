"""gpt-oss on one process (CPU, fp32): the attention op with sinks against a formula written here (every
implementation, gradients included, and the refusals of those that cannot take sinks), the clamped SwiGLU,
transformers' GptOssForCausalLM logits both ways (from_pretrained_hf, save_pretrained_hf, megacann-convert
from-hf / to-hf), what the family refuses, and the parameter counts of the built model and of the
published gpt-oss-20b configuration against transformers' model on the meta device."""

from __future__ import annotations

import json
import math

import pytest
import torch
from gpt_oss_helpers import SHAPE, attention_with_sink_column, hf_logits, tiny_hf_gpt_oss, visible_keys
from published_config_checks import check_recipe_matches_published
from training_helpers import tiny_config

from megacann import ops
from megacann.config import ConfigError
from megacann.interop import from_pretrained_hf, save_pretrained_hf
from megacann.layers.context_parallel import blockwise_attention
from megacann.layers.moe import clamped_swiglu
from megacann.layers.sharding import get_sharding
from megacann.models import ChunkPlacement, get_model_spec
from megacann.ops import npu, reference, varlen

IDS = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))


# -- the attention op with sinks -----------------------------------------------------------------------


@pytest.mark.parametrize("packed,window", [(False, None), (True, None), (False, 3), (True, 4)])
def test_sinks_on_every_attention_path_equal_the_sink_column_formula(packed, window, monkeypatch):
    monkeypatch.setattr(varlen, "DENSE_MAX_SEQ", 0)  # "varlen": the rectangles, not the short rows' masked call
    g = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 2, 12, 4, 2, 8
    q, k, v = (torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g, dtype=torch.float64) * 2
    segments = torch.tensor([[0] * 5 + [1] * 7, [0] * 12]) if packed else torch.zeros(b, s, dtype=torch.long)
    expected = attention_with_sink_column(q, k, v, sinks, visible_keys(segments, window))
    grad_out = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    want = torch.autograd.grad(attention_with_sink_column(*leaves, visible_keys(segments, window)), leaves, grad_out)
    seg = segments if packed else None
    impls = {
        "reference": lambda *t: reference.scaled_dot_product_attention(
            *t[:3], segment_ids=seg, sliding_window=window, sinks=t[3]
        ),
        "varlen": lambda *t: varlen.varlen_attention(
            *t[:3],
            causal=True,
            segment_ids=seg,
            attn_mask=None,
            dropout_p=0.0,
            scale=None,
            sliding_window=window,
            sinks=t[3],
        ),  # fmt: skip
        "dispatched": lambda *t: ops.scaled_dot_product_attention(
            *t[:3], segment_ids=seg, sliding_window=window, sinks=t[3]
        ),
    }
    for name, attend in impls.items():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = attend(*leaves)
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=0, msg=name)
        for got, ref in zip(torch.autograd.grad(out, leaves, grad_out), want):
            torch.testing.assert_close(got, ref, atol=1e-11, rtol=0, msg=name)
    # sinks change the result (a zero-weight sink column would not be tested above)
    assert (
        reference.scaled_dot_product_attention(q, k, v, segment_ids=seg, sliding_window=window) - expected
    ).abs().max() > 0.05


def test_sinks_are_refused_by_name_where_an_implementation_cannot_take_them():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"sinks \(attention sinks, gpt-oss\) are not supported by torch_npu"):
        npu.scaled_dot_product_attention(q, q, q, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match=r"sinks must hold one logit per query head, shape \(2,\), got \(3,\)"):
        ops.scaled_dot_product_attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match=r"sinks must hold one logit per query head, shape \(2,\), got \(3,\)"):
        blockwise_attention(q, q, q, sinks=torch.zeros(3))
    for algo in ("ring", "allgather", "ulysses"):  # every context-parallel algorithm takes the sinks
        cp2 = ["distributed.context_parallel_size=2", f"distributed.context_parallel_algo={algo}"]
        assert tiny_config(GPT_OSS + cp2, world_size=2).distributed.context_parallel_algo == algo


def test_clamped_swiglu_equals_gpt_oss_formula():
    gate = torch.tensor([-9.0, -1.0, 0.5, 3.0, 9.0])
    up = torch.tensor([-9.0, 2.0, -0.5, 8.0, 1.0])
    limit, alpha = 7.0, 1.702
    clamped_gate, clamped_up = torch.tensor([-9.0, -1.0, 0.5, 3.0, 7.0]), torch.tensor([-7.0, 2.0, -0.5, 7.0, 1.0])
    expected = (clamped_up + 1) * clamped_gate / (1 + torch.exp(-alpha * clamped_gate))
    torch.testing.assert_close(clamped_swiglu(torch.cat([gate, up]), limit, alpha), expected)


# -- Hugging Face both ways ----------------------------------------------------------------------------


def test_hf_logits_parity_both_ways_and_through_convert(tmp_path):
    import transformers

    from megacann.convert import main as convert

    hf_dir = tiny_hf_gpt_oss(str(tmp_path / "hf"))
    expected = hf_logits(hf_dir, IDS)
    ours = from_pretrained_hf(hf_dir).eval()
    assert ours.config.type == "gpt_oss"
    windows = [block.self_attn.sliding_window for block in ours.layers.values()]
    assert windows == [5, None, 5, None]  # layer_types: sliding, full, ...
    attn, moe = ours.layers["0"].self_attn, ours.layers["0"].mlp
    assert attn.sinks.shape == (4,) and attn.q_proj.bias is not None and attn.o_proj.bias is not None
    assert moe.router.bias.shape == (4,) and moe.experts["3"].down_proj.bias.shape == (64,)
    assert moe.config.activation.kind == "clamped_swiglu" and moe.config.activation.limit == 1.5
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=IDS), expected, atol=1e-4, rtol=0)
    assert expected.std() > 0.5  # logits that differ enough to tell a mix-up

    save_pretrained_hf([ours], str(tmp_path / "back"), ours.config)
    assert convert(["from-hf", hf_dir, str(tmp_path / "whole")]) == 0
    assert convert(["to-hf", str(tmp_path / "whole"), str(tmp_path / "converted")]) == 0
    reference_state = transformers.GptOssForCausalLM.from_pretrained(hf_dir).state_dict()
    for out in ("back", "converted"):
        torch.testing.assert_close(hf_logits(str(tmp_path / out), IDS), expected, atol=1e-4, rtol=0)
        again = transformers.GptOssForCausalLM.from_pretrained(str(tmp_path / out)).state_dict()
        assert again.keys() == reference_state.keys()
        for name, tensor in reference_state.items():
            assert torch.equal(again[name], tensor), (out, name)


# -- what the family refuses ---------------------------------------------------------------------------

GPT_OSS = ["model.type=gpt_oss", "model.num_experts=4", "model.head_dim=16"]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"layer_types": ["sliding_attention", "linear_attention", "full_attention", "full_attention"]},
         r"layer_types\[1\] 'linear_attention' is not implemented by megacann's gpt_oss"),
        ({"layer_types": ["full_attention"]}, r"layer_types must list one attention kind per layer \(4\)"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}},
         r"rope_type 'longrope' is not implemented by megacann's gpt_oss"),
        ({"num_experts_per_tok": 1}, r"num_experts_per_tok \(model.moe_top_k\) 1 is refused"),
        ({"hidden_act": "relu"}, r"hidden_act 'relu' is not supported"),
    ],
)  # fmt: skip
def test_config_json_the_family_does_not_implement_is_refused_naming_key_and_value(tmp_path, change, message):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt_oss", **SHAPE, **change}))
    with pytest.raises(ConfigError, match=message):
        get_model_spec("gpt_oss").hf.config_from_hf(str(config))


def test_recipe_refusals_name_the_key():
    with pytest.raises(ConfigError, match=r"moe_shared_experts 1 .* gpt-oss has an MoE layer in every layer"):
        tiny_config(GPT_OSS + ["model.moe_shared_experts=1"])
    with pytest.raises(ConfigError, match=r"swiglu_limit must be > 0, got -1.0"):
        tiny_config(GPT_OSS + ["model.swiglu_limit=-1.0"])


# -- sizes ---------------------------------------------------------------------------------------------


def test_parameter_formulas_count_the_built_model():
    cfg = tiny_config(GPT_OSS)
    spec = get_model_spec("gpt_oss")
    with torch.device("meta"):
        model = spec.build(cfg, ChunkPlacement(tuple(range(cfg.model.num_layers))), "meta")
    total = sum(math.prod(get_sharding(p).logical_shape) for p in model.parameters())  # vocabulary unpadded
    assert spec.total_parameters(cfg.model) == total
    m = cfg.model
    idle_experts = m.num_layers * (m.num_experts - m.moe_top_k)
    per_expert = 3 * m.hidden_size * m.moe_ffn_hidden_size + 2 * m.moe_ffn_hidden_size + m.hidden_size
    assert spec.parameters_per_token(m) == total - idle_experts * per_expert


# The published openai/gpt-oss-20b config.json (the keys that decide shapes), as on the Hugging Face Hub.
PUBLISHED_20B = {
    "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "num_local_experts": 32,
    "num_experts_per_tok": 4, "rms_norm_eps": 1e-5, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "attention_bias": True, "max_position_embeddings": 131072,
    "rope_theta": 150000, "router_aux_loss_coef": 0.9,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}  # fmt: skip
EXPECTED_20B = (20_914_757_184, 4_187_440_704)  # transformers' count below: total, active per token


def test_gpt_oss_20b_recipe_counts_what_transformers_counts(tmp_path):
    import transformers

    keys = {k: v for k, v in PUBLISHED_20B.items() if k not in ("rope_theta", "rope_scaling")}
    rope = {**PUBLISHED_20B["rope_scaling"], "rope_theta": PUBLISHED_20B["rope_theta"]}
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**keys, rope_parameters=rope))
    total = sum(p.numel() for p in model.parameters())
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    per_expert = sum(p.numel() for e in experts for p in e.parameters()) // (len(experts) * 32)
    active = total - len(experts) * (32 - 4) * per_expert
    assert (total, active) == EXPECTED_20B
    cfg, from_hf = check_recipe_matches_published(tmp_path, "gpt_oss/gpt_oss_20b.yaml", PUBLISHED_20B, total, active)
    assert from_hf.rope_scaling == cfg.model.rope_scaling and from_hf.rope_theta == cfg.model.rope_theta
