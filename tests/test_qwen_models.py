"""The Qwen families on one process (CPU, fp32): transformers' Qwen2 / Qwen3 / Qwen3-MoE logits both ways
(from_pretrained_hf, save_pretrained_hf, megacann-convert from-hf / to-hf), PEFT adapters on the Hugging
Face base, the fused qkv projection with q/k norms, what the families refuse, and the parameter counts of
the real-size recipes against transformers' models of the published configs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from published_config_checks import check_recipe_matches_published
from qwen_helpers import FAMILY_SETTINGS, SHAPE, hf_classes, hf_logits, tiny_hf_qwen
from training_helpers import tiny_config

from megacann.config import ConfigError, MegacannConfig
from megacann.interop.hf import from_pretrained_hf, save_pretrained_hf
from megacann.layers.sharding import get_sharding
from megacann.models import ChunkPlacement, get_model_spec, prepare_model_config

transformers = pytest.importorskip("transformers")
FAMILIES = sorted(FAMILY_SETTINGS)
IDS = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_logits_parity_both_ways_and_through_convert(tmp_path, family):
    from megacann.convert import main as convert

    hf_dir = tiny_hf_qwen(str(tmp_path / "hf"), family)
    expected = hf_logits(hf_dir, family, IDS)
    ours = from_pretrained_hf(hf_dir).eval()
    assert ours.config.type == family
    attn = ours.layers["0"].self_attn
    head_dim = FAMILY_SETTINGS[family].get("head_dim", 16)
    assert attn.q_proj.weight.shape == (4 * head_dim, 64)
    assert (attn.q_proj.bias is not None) == (family == "qwen2") and attn.o_proj.bias is None
    assert (attn.q_norm is not None) == (family != "qwen2")
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=IDS), expected, atol=1e-4, rtol=0)

    save_pretrained_hf([ours], str(tmp_path / "back"), ours.config)
    assert convert(["from-hf", hf_dir, str(tmp_path / "whole")]) == 0
    assert convert(["to-hf", str(tmp_path / "whole"), str(tmp_path / "converted")]) == 0
    reference = hf_classes(family)[1].from_pretrained(hf_dir).state_dict()
    for out in ("back", "converted"):
        torch.testing.assert_close(hf_logits(str(tmp_path / out), family, IDS), expected, atol=1e-4, rtol=0)
        again = hf_classes(family)[1].from_pretrained(str(tmp_path / out)).state_dict()
        assert again.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(again[name], tensor), (out, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_adapters_on_the_hf_base_give_megacann_logits(tmp_path, family):
    peft = pytest.importorskip("peft")
    from megacann.interop.peft import save_peft_adapter
    from megacann.layers.lora import LoRAConfig, attach_lora, lora_parameters

    hf_dir = tiny_hf_qwen(str(tmp_path / "hf"), family)
    model = from_pretrained_hf(hf_dir).eval()
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    if family == "qwen3_moe":  # MLP names reach the experts, whose per-expert adapters PEFT 0.21 does not put
        targets = targets[:4]  # onto transformers 5's fused Qwen3-MoE experts (it does for Mixtral)
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=targets)
    attach_lora(model, lora)
    with torch.no_grad():
        for _, p in lora_parameters(model):  # lora_B starts at zero: give both factors weight
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    with torch.no_grad():
        ours = model(input_ids=IDS)
    save_peft_adapter([model], str(tmp_path / "adapter"), lora, base_model_name_or_path=hf_dir)
    base = hf_classes(family)[1].from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        assert (ours - base(IDS).logits).abs().max() > 0.05  # the adapters act
        theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()(IDS).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


def test_qk_norm_with_the_fused_qkv_projection_equals_separate_projections():
    from megacann.layers import SelfAttention, initialize_weights
    from megacann.models.hf_llama import hf_parts
    from megacann.models.qwen_config import Qwen3ModelConfig

    separate = SelfAttention(64, 4, 2, head_dim=24, qk_norm=True, qk_norm_eps=1e-6)
    fused = SelfAttention(64, 4, 2, head_dim=24, qk_norm=True, qk_norm_eps=1e-6, fused_qkv=True)
    initialize_weights(separate, 5)
    with torch.no_grad():
        separate.q_norm.weight.uniform_(0.5, 1.5)
        separate.k_norm.weight.uniform_(0.5, 1.5)
        fused.qkv_proj.weight.copy_(torch.cat([separate.q_proj.weight, separate.k_proj.weight, separate.v_proj.weight]))
        for name in ("o_proj.weight", "q_norm.weight", "k_norm.weight"):
            fused.get_parameter(name).copy_(separate.get_parameter(name))
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fused(x), separate(x), atol=1e-6, rtol=0)
    # a fused weight's Hugging Face parts are split by Qwen3's head width (PEFT names of a fused LoRA)
    cfg = Qwen3ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24)
    parts = hf_parts("layers.0.self_attn.qkv_proj.weight", cfg)
    assert [rows for _, rows in parts] == [96, 48, 48] and parts[0][0] == "model.layers.0.self_attn.q_proj.weight"


# -- what the families refuse ------------------------------------------------------------------------

QWEN3_MOE = ["model.type=qwen3_moe", "model.num_experts=4", "model.moe_ffn_hidden_size=32"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.type=qwen2", "model.use_sliding_window=true"], r"use_sliding_window true is refused: .*qwen2"),
        (["model.type=qwen3", "model.add_bias_linear=true"], r"add_bias_linear true is refused"),
        (["model.type=qwen3", "model.head_dim=15"], r"model.head_dim must be a positive even number"),
        (QWEN3_MOE + ["model.moe_layer_freq=2"], r"moe_layer_freq 2 disagrees with decoder_sparse_step 1"),
        (QWEN3_MOE + ["model.mlp_only_layers=[4]"], r"mlp_only_layers \[4\] are not layer indices"),
        (QWEN3_MOE + ["model.moe_shared_experts=1"], r"Qwen3-MoE routes by softmax without shared experts"),
        (QWEN3_MOE + ["model.moe_top_k=1", "model.norm_topk_prob=true"], r"norm_topk_prob with moe_top_k 1"),
        (["model.type=qwen2", "model.head_dim=32"], r"'model.head_dim' for model.type 'qwen2'"),
    ],
)
def test_refusals_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(overrides)


def test_qwen3_moe_layers_follow_sparse_step_and_mlp_only_layers(tmp_path):
    cfg = tiny_config(QWEN3_MOE + ["model.decoder_sparse_step=2", "model.mlp_only_layers=[3]"])
    assert cfg.model.moe_layer_freq == [0, 1, 0, 0]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 4096}))
    read = get_model_spec("qwen3").hf.config_from_hf(str(config))
    with pytest.raises(ConfigError, match=r"use_sliding_window true is refused: megacann's qwen3 family"):
        prepare_model_config(MegacannConfig(model=read))
    from megacann.models.hf_qwen import moe_to_hf

    m = tiny_config(QWEN3_MOE + ["model.moe_bias_update_rate=0.01"]).model
    with pytest.raises(ConfigError, match=r"moe_bias_update_rate 0.01 cannot be written as Qwen3-MoE"):
        moe_to_hf({}, m)


# -- sizes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_formulas_count_the_built_model(family):
    cfg = tiny_config([f"model.type={family}", "model.tie_word_embeddings=true"] + _own_keys(family))
    spec = get_model_spec(family)
    with torch.device("meta"):
        model = spec.build(cfg, ChunkPlacement(tuple(range(cfg.model.num_layers))), "meta")
    total = sum(math.prod(get_sharding(p).logical_shape) for p in model.parameters())  # vocabulary unpadded
    assert spec.total_parameters(cfg.model) == total
    m = cfg.model
    unused = 0 if family != "qwen3_moe" else 3 * (4 - 2) * 3 * m.hidden_size * m.moe_ffn_hidden_size
    assert spec.parameters_per_token(m) == total - unused


def _own_keys(family: str) -> list[str]:
    if family == "qwen2":
        return []
    moe = ["model.num_experts=4", "model.moe_ffn_hidden_size=32", "model.mlp_only_layers=[0]"]
    return ["model.head_dim=24"] + (moe if family == "qwen3_moe" else [])


# The published config.json of each real size (the keys that decide shapes), as on the Hugging Face Hub.
PUBLISHED = {
    "qwen2/qwen2.5_7b.yaml": {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "max_position_embeddings": 32768,
        "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28,
    },
    "qwen3/qwen3_8b.yaml": {
        "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False,
        "max_position_embeddings": 40960, "use_sliding_window": False,
    },
    "qwen3_moe/qwen3_30b_a3b.yaml": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False,
        "max_position_embeddings": 40960, "use_sliding_window": False, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
}  # fmt: skip
# what the dry run prints (the counts of transformers' models below): total, active per token
EXPECTED = {
    "qwen2/qwen2.5_7b.yaml": (7_615_616_512, 7_615_616_512),
    "qwen3/qwen3_8b.yaml": (8_190_735_360, 8_190_735_360),
    "qwen3_moe/qwen3_30b_a3b.yaml": (30_532_122_624, 3_353_032_704),
}


def _hf_counts(config: dict) -> tuple[int, int]:
    """Parameters of transformers' model of ``config`` (built on the meta device), and those one token
    meets: all but the experts it is not routed to (num_experts - num_experts_per_tok per MoE layer)."""
    config_class, model_class = hf_classes(config["model_type"])
    with torch.device("meta"):
        model = model_class(config_class(**{k: v for k, v in config.items() if k != "model_type"}))
    total = sum(p.numel() for p in model.parameters())
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    idle = config.get("num_experts", 0) - config.get("num_experts_per_tok", 0)
    per_expert = sum(p.numel() for e in experts for p in e.parameters()) // max(
        1, len(experts) * config.get("num_experts", 1)
    )
    return total, total - len(experts) * idle * per_expert


@pytest.mark.parametrize("recipe", sorted(PUBLISHED))
def test_real_size_recipes_count_what_transformers_counts(tmp_path, recipe):
    total, active = _hf_counts(PUBLISHED[recipe])
    assert (total, active) == EXPECTED[recipe]
    cfg, from_hf = check_recipe_matches_published(tmp_path, recipe, PUBLISHED[recipe], total, active)
    assert math.isclose(from_hf.rope_theta, cfg.model.rope_theta) and from_hf.norm_eps == cfg.model.norm_eps
