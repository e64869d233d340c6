"""The MoE family on one process: Hugging Face Mixtral parity both ways (and through megacann-convert),
the recipe keys and their refusals, sizes and FLOPs, the dry run of the cluster recipes, the load warning."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
from training_helpers import tiny_config, tiny_hf_mixtral

from megacann.config import ConfigError, MegacannConfig, ModelConfig, load_config
from megacann.interop.hf import from_pretrained_hf, save_pretrained_hf
from megacann.models import MOE, ChunkPlacement, prepare_model_config
from megacann.models.hf_mixtral import hf_config_dict
from megacann.models.moe import expert_load_warnings, moe_flops_per_token
from megacann.models.moe_config import MoEModelConfig
from megacann.models.mtp import MTPKeys
from megacann.models.sizing import padded_vocab_size

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "configs" / "moe"
MOE_RECIPE = ["model.type=moe", "model.num_experts=4"]


# -- Hugging Face Mixtral ------------------------------------------------------------------------------


def test_mixtral_logits_parity_both_ways_and_through_convert(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megacann.convert import main as convert

    # vocab 300 is not a multiple of 128: megacann pads, and must not show it
    tiny_hf_mixtral(str(tmp_path / "hf"), vocab_size=300, seed=0, rope_theta=50000.0)
    reference = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    ours = from_pretrained_hf(str(tmp_path / "hf")).eval()
    assert ours.config.type == "moe" and ours.config.num_experts == 4 and ours.config.moe_ffn_hidden_size == 48
    with torch.no_grad():
        logits = ours(input_ids=ids)
    assert logits.shape == (2, 24, 300)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)

    save_pretrained_hf([ours], str(tmp_path / "back"), ours.config)
    assert convert(["from-hf", str(tmp_path / "hf"), str(tmp_path / "whole")]) == 0
    assert convert(["to-hf", str(tmp_path / "whole"), str(tmp_path / "converted")]) == 0
    for out in ("back", "converted"):
        again = transformers.MixtralForCausalLM.from_pretrained(tmp_path / out, attn_implementation="eager").eval()
        with torch.no_grad():
            torch.testing.assert_close(again(ids).logits, expected, atol=1e-4, rtol=0)
        for name, p in reference.state_dict().items():
            assert torch.equal(again.state_dict()[name], p), (out, name)


def test_what_mixtral_cannot_express_is_refused(tmp_path):
    base = MoEModelConfig(hidden_size=32, num_layers=2, num_attention_heads=4, num_experts=4)
    MOE.fill_defaults(base)
    hf_config_dict(base, torch.float32)  # plain top-2 softmax routing: fine
    for key, value in [("moe_shared_experts", 1), ("moe_router", "sigmoid"), ("moe_layer_freq", 2)]:
        bad = MoEModelConfig(**{**base.__dict__, key: value})
        with pytest.raises(ConfigError, match=rf"model.{key} .* cannot be written as Mixtral"):
            hf_config_dict(bad, torch.float32)
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "mixtral", "num_local_experts": 4, "sliding_window": 4096}')
    from megacann.models.hf_mixtral import model_config_from_hf

    with pytest.raises(ConfigError, match=r"sliding_window 4096 is not supported \(only None\)"):
        model_config_from_hf(str(config))


# -- recipe keys ---------------------------------------------------------------------------------------

NON_DEFAULT = {
    "num_experts": "4",
    "moe_top_k": "1",
    "moe_router": "sigmoid",
    "moe_capacity_factor": "1.25",
    "moe_aux_loss_coeff": "0.01",
    "moe_router_load_balancing_type": "seq_aux_loss",
    "moe_z_loss_coeff": "0.001",
    "moe_bias_update_rate": "0.001",
    "moe_layer_freq": "2",
    "moe_shared_experts": "1",
    "moe_ffn_hidden_size": "64",
}


def test_every_moe_key_has_a_refusal_case():
    shared = {f.name for f in dataclasses.fields(ModelConfig)} | {f.name for f in dataclasses.fields(MTPKeys)}
    own = {f.name for f in dataclasses.fields(MoEModelConfig)} - shared  # multi-token prediction's: test_mtp.py
    assert set(NON_DEFAULT) == own


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("key", sorted(NON_DEFAULT))
def test_dense_families_refuse_moe_keys(family, key):
    tiny_config([f"model.type={family}"])  # defaults pass
    with pytest.raises(
        ConfigError, match=rf"'model.{key}' for model.type '{family}': it is a key of model family (.* / )?'moe'"
    ):
        tiny_config([f"model.type={family}", f"model.{key}={NON_DEFAULT[key]}"])


def test_dense_families_refuse_expert_parallelism():
    with pytest.raises(ConfigError, match=r"distributed.expert_parallel_size: 2 is refused: .*'llama' has no experts"):
        tiny_config(["distributed.expert_parallel_size=2"], world_size=4)
    tiny_config(MOE_RECIPE + ["distributed.expert_parallel_size=2"], world_size=4)  # the moe family takes it


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.type=moe"], r"model.num_experts is not set"),
        (MOE_RECIPE + ["model.moe_top_k=5"], r"model.moe_top_k must be in \[1, num_experts=4\], got 5"),
        (MOE_RECIPE + ["model.moe_layer_freq=[1,0]"], r"model.moe_layer_freq as a list needs one 0 .* per layer \(4\)"),
        (MOE_RECIPE + ["model.moe_layer_freq=[0,0,0,0]"], r"makes no layer an MoE layer"),
        (MOE_RECIPE + ["model.moe_layer_freq=0"], r"model.moe_layer_freq must be >= 1"),
        (MOE_RECIPE + ["model.moe_capacity_factor=0"], r"model.moe_capacity_factor must be > 0 \(or null"),
        (MOE_RECIPE + ["model.moe_bias_update_rate=-1"], r"model.moe_bias_update_rate must be >= 0"),
        (MOE_RECIPE + ["model.moe_router=sigmoidd"], r"model.moe_router: 'sigmoidd' is not one of softmax, sigmoid"),
        (
            MOE_RECIPE + ["model.moe_ffn_hidden_size=33", "distributed.tensor_parallel_size=2"],
            r"divisible by .*tensor_p",
        ),
    ],
)
def test_moe_recipe_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(overrides, world_size=2)


def test_experts_must_divide_over_expert_parallel_ranks():
    with pytest.raises(ConfigError, match=r"model.num_experts 4 is not divisible by .*expert_parallel_size 8"):
        tiny_config(MOE_RECIPE + ["distributed.expert_parallel_size=8", "data.batch_size=1"], world_size=8)


# -- sizes and FLOPs -----------------------------------------------------------------------------------


def test_parameter_counts_match_the_built_model():
    m = MoEModelConfig(
        hidden_size=32,
        num_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        ffn_hidden_size=48,
        vocab_size=128,
        tie_word_embeddings=True,
        num_experts=6,
        moe_top_k=2,
        moe_ffn_hidden_size=16,
        moe_shared_experts=2,
        moe_layer_freq=[0, 1, 1],
    )
    cfg = MegacannConfig(model=m)
    prepare_model_config(cfg)
    with torch.device("meta"):
        model = MOE.build_chunk(cfg, ChunkPlacement((0, 1, 2)), "meta")
    total = sum(p.numel() for p in model.parameters())
    assert MOE.total_parameters(m) == total
    h, ffn = 32, 16
    unused_experts = 2 * (6 - 2) * 3 * h * ffn  # two MoE layers, four experts a token does not meet
    assert MOE.parameters_per_token(m) == total - unused_experts


def test_every_moe_family_is_derived_from_the_moe_spec():
    """Qwen3-MoE and DeepSeek-V3 come from moe_model_spec: the MoE runtime (forward step with auxiliary
    losses and expert counts, router-bias update, load warnings, expert parallelism) is MoE's, while
    build, checks, adapter and counts are the family's own."""
    from megacann.models import DEEPSEEK_V3, QWEN3_MOE

    shared = ("forward_step", "after_optimizer_step", "metric_warnings", "mixture_of_experts", "sharding_units")
    for spec in (QWEN3_MOE, DEEPSEEK_V3):
        assert [getattr(spec, key) for key in shared] == [getattr(MOE, key) for key in shared], spec.name
        own = ("name", "build_chunk", "check_config", "fill_defaults", "hf", "config_class", "num_parameters")
        assert all(getattr(spec, key) is not getattr(MOE, key) for key in own), spec.name
        assert spec.architecture != MOE.architecture  # q/k norms, latent attention
    m = MoEModelConfig(hidden_size=32, num_layers=2, num_attention_heads=4, vocab_size=64, num_experts=4)
    MOE.fill_defaults(m)
    assert MOE.active_parameters(m) == MOE.num_parameters(m) - 2 * 2 * 3 * 32 * m.moe_ffn_hidden_size


def test_mixtral_8x7b_sizes_and_flops():
    cfg = load_config(str(RECIPES / "mixtral_8x7b.yaml"))
    prepare_model_config(cfg)
    m = cfg.model
    assert MOE.total_parameters(m) == 46_702_792_704  # Mixtral-8x7B's published 46.7 B
    assert MOE.parameters_per_token(m) == 12_879_925_248  # and 12.9 B active
    h, L, kv = 4096, 32, 8 * 128
    per_layer = 2 * h * h + 2 * h * kv + 8 * h + 2 * 3 * h * 14336  # attention, router, top-2 experts
    assert moe_flops_per_token(m, 4096) == 6 * (L * per_layer + 32000 * h) + 12 * L * h * 4096
    assert MOE.flops_per_token is moe_flops_per_token


@pytest.mark.parametrize("recipe", ["mixtral_8x7b.yaml", "deepseek_style_16b.yaml"])
def test_dry_run_shows_layout_and_total_and_active_parameters(recipe):
    from megacann.dry_run import describe

    cfg = load_config(str(RECIPES / recipe))
    text = describe(cfg, recipe)
    m, d = cfg.model, cfg.distributed
    total, active = MOE.total_parameters(m), MOE.parameters_per_token(m)
    assert active < total
    assert f"moe: {total:,} parameters" in text
    assert f"active per token: {active:,} parameters" in text
    assert f"(ep {d.expert_parallel_size} within dp)" in text
    groups = re.search(r"expert-parallel groups \((\d+)\)", text)
    assert groups and int(groups[1]) == d.world_size // d.expert_parallel_size
    assert padded_vocab_size(m.vocab_size, d.tensor_parallel_size, m.make_vocab_size_divisible_by) == m.vocab_size


@pytest.mark.parametrize("recipe", ["mixtral_8x7b.yaml", "deepseek_style_16b.yaml"])
def test_the_memory_planner_counts_the_parameters_the_family_counts(recipe):
    """On one rank the planner's parameters (router, shared experts, dense first layer) are the family's
    count; with ep 8 each rank holds an eighth of the routed experts."""
    from megacann.planning import estimate_stages
    from megacann.planning.formulas import Layout

    cfg = load_config(str(RECIPES / recipe))
    prepare_model_config(cfg)
    m = cfg.model
    (one,) = estimate_stages(cfg, Layout())
    assert one.params == MOE.total_parameters(m)  # vocabularies a multiple of 128: no padding
    (spread,) = estimate_stages(cfg, Layout(dp=8, ep=8))
    layers = sum(1 for i in range(m.num_layers) if (m.moe_layer_freq[i] if isinstance(m.moe_layer_freq, list) else 1))
    routed = layers * m.num_experts * 3 * m.hidden_size * m.moe_ffn_hidden_size
    assert (one.expert_params, spread.expert_params) == (routed, routed // 8)
    assert one.params - spread.params == routed - routed // 8


# -- the console's load warning ------------------------------------------------------------------------


def test_expert_load_warnings():
    balanced = {"moe_tokens_per_expert/layer_0": [100.0, 90.0, 110.0, 100.0]}
    assert expert_load_warnings(balanced) == []
    skewed = {
        "moe_tokens_per_expert/layer_0": [100.0, 90.0, 110.0, 100.0],
        "moe_tokens_per_expert/layer_3": [9.0, 10.0, 31.0, 350.0],  # fair share 100
        "moe_load_balancing": 0.01,
    }
    assert expert_load_warnings(skewed) == [
        "MoE layer 3: fair share 100 token choices per expert; expert(s) [0] got under 1/10 of it ([9]); "
        "expert(s) [3] over 3x ([350]) (balance with model.moe_aux_loss_coeff or model.moe_bias_update_rate)"
    ]
    assert math.isclose(sum(skewed["moe_tokens_per_expert/layer_3"]) / 4, 100.0)
