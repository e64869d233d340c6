"""The deepseek_v3 family on one process (CPU, fp32): transformers' DeepseekV3ForCausalLM logits both ways
(from_pretrained_hf, save_pretrained_hf, megacann-convert from-hf / to-hf) with low-rank or plain queries,
rotate-half or interleaved RoPE and YaRN scaling; the group-limited router against transformers' router;
PEFT adapters on the latent-attention projections; what the family refuses; and the parameter counts of
the real-size recipes against transformers' models of the published configs."""

from __future__ import annotations

import json

import pytest
import torch
from deepseek_helpers import SHAPE, VARIANTS, hf_logits, tiny_deepseek_with_mtp, tiny_hf_deepseek
from published_config_checks import check_recipe_matches_published
from training_helpers import tiny_config

from megacann.config import ConfigError
from megacann.interop.hf import from_pretrained_hf, save_pretrained_hf

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hf_logits_parity_both_ways_and_through_convert(tmp_path, variant):
    from megacann.convert import main as convert

    hf_dir = tiny_hf_deepseek(str(tmp_path / "hf"), variant)
    expected = hf_logits(hf_dir, IDS)
    ours = from_pretrained_hf(hf_dir).eval()
    assert ours.config.type == "deepseek_v3" and ours.config.moe_layer_freq == [0, 1, 1, 1]
    attn = ours.layers["0"].self_attn
    assert (attn.q_proj is None) == (variant == "yarn") and attn.kv_b_proj.weight.shape == (4 * (16 + 12), 24)
    bias = ours.layers["1"].mlp.router.expert_bias
    assert not bias.requires_grad and bias.abs().max() > 0  # the checkpoint's routing bias came in
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=IDS), expected, atol=1e-4, rtol=0)

    save_pretrained_hf([ours], str(tmp_path / "back"), ours.config)
    outs = ["back"]
    if variant == "yarn":  # through megacann-convert too (one variant is enough: the adapter is the same)
        assert convert(["from-hf", hf_dir, str(tmp_path / "whole")]) == 0
        assert convert(["to-hf", str(tmp_path / "whole"), str(tmp_path / "converted")]) == 0
        outs.append("converted")
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir).state_dict()
    for out in outs:
        torch.testing.assert_close(hf_logits(str(tmp_path / out), IDS), expected, atol=1e-4, rtol=0)
        again = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / out)).state_dict()
        assert again.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(again[name], tensor), (out, name)


def test_group_limited_router_chooses_and_weighs_as_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from megacann.layers.moe.router import TopKRouter

    config = transformers.DeepseekV3Config(**{**SHAPE, "n_routed_experts": 16, "num_experts_per_tok": 3})
    theirs = DeepseekV3TopkRouter(config)
    ours = TopKRouter(64, 16, 3, "sigmoid", routed_scaling_factor=2.5, num_groups=4, top_k_groups=2, expert_bias=True)
    with torch.no_grad():
        theirs.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
        theirs.e_score_correction_bias.uniform_(-0.2, 0.2, generator=torch.Generator().manual_seed(3))
        ours.weight.copy_(theirs.weight)
        ours.expert_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    _, weights, ids = theirs(x)
    routing = ours(x)
    order, their_order = routing.expert_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(routing.expert_ids.gather(1, order), ids.gather(1, their_order))
    torch.testing.assert_close(routing.probs.gather(1, order), weights.gather(1, their_order), atol=1e-6, rtol=0)
    # the groups really limit the choice: every token's experts lie in at most 2 of the 4 groups
    assert max(len(set((row // 4).tolist())) for row in routing.expert_ids) == 2


def test_frozen_routing_bias_is_a_parameter_the_balancing_update_moves():
    from megacann.layers.moe import MoEConfig, MoELayer, update_expert_biases

    layer = MoELayer(MoEConfig(16, 4, 8, top_k=2, score_function="sigmoid", bias_update_rate=0.1, expert_bias=True))
    names = dict(layer.named_parameters())
    assert "router.expert_bias" in names and not names["router.expert_bias"].requires_grad
    layer.train()
    layer(torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))).sum().backward()
    load = layer.router.load_since_update.clone()
    update_expert_biases(layer)
    expected = 0.1 * torch.sign(load.double().mean() - load.double()).float()
    assert torch.equal(layer.router.expert_bias.detach(), expected) and layer.router.expert_bias.grad is None


def test_peft_adapters_on_latent_attention_projections_give_megacann_logits(tmp_path):
    peft = pytest.importorskip("peft")
    from megacann.interop.peft import save_peft_adapter
    from megacann.layers.lora import LoRAConfig, attach_lora, lora_parameters

    hf_dir = tiny_hf_deepseek(str(tmp_path / "hf"), "yarn")
    model = from_pretrained_hf(hf_dir).eval()
    targets = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=targets)
    attach_lora(model, lora)
    with torch.no_grad():
        for _, p in lora_parameters(model):  # lora_B starts at zero: give both factors weight
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
        ours = model(input_ids=IDS)
    save_peft_adapter([model], str(tmp_path / "adapter"), lora, base_model_name_or_path=hf_dir)
    base = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        assert (ours - base(IDS).logits).abs().max() > 0.05  # the adapters act
        theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()(IDS).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


# -- what the family refuses ---------------------------------------------------------------------------

DS = ["model.type=deepseek_v3", "model.num_experts=8", "model.moe_ffn_hidden_size=32", "model.kv_lora_rank=16"]
DS += ["model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8", "model.num_key_value_heads=4"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (DS + ["model.moe_router=softmax"], r"moe_router"),
        (DS + ["model.n_group=3"], r"n_group 3 must divide num_experts 8"),
        (DS + ["model.n_group=4", "model.topk_group=1", "model.moe_top_k=3"], r"moe_top_k 3 exceeds the experts"),
        (DS + ["model.moe_layer_freq=1", "model.first_k_dense_replace=1"], r"disagrees with first_k_dense_replace"),
        (DS + ["model.qk_rope_head_dim=7"], r"qk_rope_head_dim must be a positive even number"),
        (DS + ["model.add_bias_linear=true"], r"add_bias_linear .* true is refused"),
        (DS + ["model.num_key_value_heads=2"], r"num_key_value_heads 2 must equal num_attention_heads"),
    ],
)
def test_refusals_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(overrides)


def test_mtp_depths_without_weights_are_left_out_with_a_note(tmp_path, capsys):
    from megacann.interop.hf import hf_family

    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "model_type": "deepseek_v3", "num_mtp_layers": 1}))
    cfg = hf_family(str(tmp_path))[1]  # a config.json alone: its depths are taken as they are
    assert cfg.mtp_num_layers == 1 and cfg.q_lora_rank == 1536  # transformers' default where silent
    hf_dir = tiny_hf_deepseek(str(tmp_path / "hf"), "plain", num_mtp_layers=1)  # transformers writes no MTP
    assert hf_family(hf_dir)[1].mtp_num_layers == 0
    assert "no multi-token prediction weights (model.layers.4.eh_proj.weight)" in capsys.readouterr().err


def test_quantization_config_is_no_model_setting(tmp_path, capsys):
    """DeepSeek-V3's published config.json names its fp8 weights: the weight import reads (or refuses) them
    (tests/test_fp8_import.py), the model settings are read as without it, with no note."""
    from megacann.models import get_model_spec

    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(
        json.dumps({**SHAPE, "model_type": "deepseek_v3", "quantization_config": fp8})
    )
    cfg = get_model_spec("deepseek_v3").hf.config_from_hf(str(tmp_path / "config.json"))
    assert cfg.hidden_size == SHAPE["hidden_size"] and "quantization_config" not in capsys.readouterr().err


def test_mtp_depths_go_to_hf_layers_and_back(tmp_path):
    """A model with a multi-token prediction depth: to Hugging Face (depth j as decoder layer L + j, which
    transformers loads beside the model, its logits unchanged) and back (the same weights, the same MTP
    loss)."""
    model = tiny_deepseek_with_mtp(str(tmp_path / "out"))
    labels = torch.roll(IDS, -1, 1)
    with torch.no_grad():
        before = model(input_ids=IDS, labels=labels)
        logits = model(input_ids=IDS)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.kv_b_proj", "mlp.gate"):
        assert f"model.layers.4.{name}.weight" in names
    assert "model.layers.4.mlp.gate.e_score_correction_bias" in names
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:  # the depth's copies
        assert torch.equal(
            f.get_tensor("model.layers.4.embed_tokens.weight"), f.get_tensor("model.embed_tokens.weight")
        )
        assert torch.equal(f.get_tensor("model.layers.4.shared_head.head.weight"), f.get_tensor("lm_head.weight"))
    torch.testing.assert_close(hf_logits(str(tmp_path / "out"), IDS), logits, atol=1e-4, rtol=0)
    back = from_pretrained_hf(str(tmp_path / "out")).eval()
    assert back.config.mtp_num_layers == 1
    ours, theirs = dict(model.named_parameters()), dict(back.named_parameters())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with torch.no_grad():
        again = back(input_ids=IDS, labels=labels)
    assert (
        torch.equal(again.aux_losses["mtp_loss"], before.aux_losses["mtp_loss"]) and before.aux_losses["mtp_loss"] > 0
    )


# -- sizes ---------------------------------------------------------------------------------------------

# The published config.json of each real size (the keys that decide shapes), as on the Hugging Face Hub.
PUBLISHED = {
    "deepseek/deepseek_v3_16b.yaml": {  # moonshotai/Moonlight-16B-A3B
        "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "rms_norm_eps": 1e-5, "vocab_size": 163840,
        "max_position_embeddings": 8192, "rope_theta": 50000.0, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
    },
    "deepseek/deepseek_v3_671b.yaml": {  # deepseek-ai/DeepSeek-V3
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "vocab_size": 129280,
        "max_position_embeddings": 163840, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        "num_nextn_predict_layers": 1,
    },
}  # fmt: skip
# what the dry run prints (the counts of transformers' models below, with the MTP depth): total, active
EXPECTED = {
    "deepseek/deepseek_v3_16b.yaml": (15_960_108_544, 2_914_774_528),
    "deepseek/deepseek_v3_671b.yaml": (682_636_472_320, 38_240_382_976),
}


def _hf_counts(config: dict) -> tuple[int, int]:
    """Parameters of transformers' model of ``config`` (on the meta device) with the multi-token prediction
    depths its checkpoint stores, and those one token meets: all but the routed experts it is not sent to
    (n_routed_experts - num_experts_per_tok per MoE layer)."""
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config))
    total = sum(p.numel() for p in model.parameters())
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    per_expert = sum(p.numel() for p in experts[0].parameters()) // config["n_routed_experts"]
    idle = (config["n_routed_experts"] - config["num_experts_per_tok"]) * per_expert
    # each multi-token prediction depth (stored as one more decoder layer; transformers builds none): a layer
    # like the last, enorm, hnorm, eh_proj (2h -> h) and shared_head.norm; embedding and head are shared
    depths, h = config.get("num_nextn_predict_layers", 0), config["hidden_size"]
    mtp = depths * (sum(p.numel() for p in model.model.layers[-1].parameters()) + 3 * h + 2 * h * h)
    return total + mtp, total + mtp - (len(experts) + depths) * idle


@pytest.mark.parametrize("recipe", sorted(PUBLISHED))
def test_real_size_recipes_count_what_transformers_counts(tmp_path, recipe):
    total, active = _hf_counts(PUBLISHED[recipe])
    assert (total, active) == EXPECTED[recipe]
    cfg, from_hf = check_recipe_matches_published(tmp_path, recipe, PUBLISHED[recipe], total, active)
    assert from_hf.norm_eps == cfg.model.norm_eps and from_hf.rope_theta == cfg.model.rope_theta
    scaling = [{k: v for k, v in (s or {}).items() if k not in ("type", "rope_type", "rope_theta")} for s in
               (from_hf.rope_scaling, cfg.model.rope_scaling)]  # fmt: skip
    assert scaling[0] == scaling[1]
