"""megacann-plan and --dry_run with every ZeRO stage and both offload options (formulas; the planner's bytes
against the tensors of real runs are in tests/test_offload.py): the 7B seed recipe, ZeRO-3 and hybrid
sharding as formulas, the new families (qwen3, mistral, moe), ranked layouts that fit only with the
optimizer in host memory, the dry run's memory section, and the offload keys' errors."""

import dataclasses
import os

import pytest
from cli_helpers import ROOT

from megacann.cli import train_main
from megacann.config import ConfigError, apply_overrides, load_config
from megacann.planning import estimate_stages, layout_of, rank_layouts
from megacann.planning.formulas import layer_parameters_per_rank
from megacann.training.recipe import prepare_recipe

SEED_7B = os.path.join(ROOT, "examples/configs/llama/llama_7b.yaml")


def _recipe(path: str, overrides: list[str] = (), world_size=None):
    cfg = load_config(os.path.join(ROOT, path))
    apply_overrides(cfg, list(overrides))
    prepare_recipe(cfg, world_size=world_size)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = 8192
    return cfg


def test_seed_7b_optimizer_offload_moves_the_optimizer_to_the_host():
    cfg = _recipe("examples/configs/llama/llama_7b.yaml", ["optim.offload_optimizer=true"])
    layout = layout_of(cfg)
    assert layout.offload_optimizer and layout.zero == 1 and layout.dp == 2
    for s in estimate_stages(cfg, layout):  # bf16: master 4 + Adam 8 + gradient staging 4, of the ZeRO-1 half
        assert s.optimizer == 0 and s.host_optimizer == 16 * s.params / 2
        assert (s.weights, s.grads) == (2 * s.params, 4 * s.params)


def test_zero3_and_hybrid_sharding_formulas():
    cfg = _recipe("examples/configs/llama/llama_7b.yaml")
    base = layout_of(cfg)
    unit = sum(layer_parameters_per_rank(cfg.model, base.tp, 0))  # one layer on one TP rank
    zero3 = dataclasses.replace(base, zero=3)
    for s in estimate_stages(cfg, zero3):  # weights and grads sharded too, one layer gathered + one prefetched
        assert s.weights == pytest.approx(2 * (s.params / 2 + 2 * unit))
        assert s.grads == pytest.approx(4 * (s.params / 2 + unit))
        assert s.optimizer == pytest.approx(12 * s.params / 2)
    wide = dataclasses.replace(base, dp=8, zero=1)
    hybrid = dataclasses.replace(wide, zero_group=2)  # shard in pairs, replicate over the 4 pairs
    assert hybrid.zero_shards == 2 and wide.zero_shards == 8
    for h, w in zip(estimate_stages(cfg, hybrid), estimate_stages(cfg, wide)):
        assert h.optimizer == pytest.approx(4 * w.optimizer)


@pytest.mark.parametrize(
    "recipe",
    ["examples/configs/qwen3/tiny.yaml", "examples/configs/mistral/tiny.yaml", "examples/configs/moe/tiny.yaml"],
)
def test_new_families_offload_and_activation_offload(recipe):
    plain = _recipe(recipe, ["distributed.world_size=4", "distributed.zero_optimization=1"], world_size=4)
    cfg = _recipe(
        recipe,
        [
            "distributed.world_size=4",
            "distributed.zero_optimization=1",
            "optim.offload_optimizer=true",
            "training.activation_offload_layers=2",
        ],
        world_size=4,
    )
    layout = layout_of(cfg)
    assert layout.offload_layers == (0, 1)
    for before, after in zip(estimate_stages(plain, layout_of(plain)), estimate_stages(cfg, layout)):
        share = (after.params - after.expert_params) / layout.zero_shards
        share += after.expert_params / layout.expert_zero_shards
        assert after.optimizer == 0 and after.host_optimizer == pytest.approx(16 * share)
        assert after.host_activations > 0 and after.activations < before.activations


@pytest.mark.extended
def test_ranked_layouts_use_offload_only_where_nothing_else_fits():
    cfg = _recipe("examples/configs/llama/llama_7b.yaml")
    ranked = rank_layouts(cfg, 8, 40e9)
    assert ranked and any(r.layout.offload_optimizer for r in ranked)
    for r in ranked:
        if r.layout.offload_optimizer:  # the same layout without offload does not fit
            without = dataclasses.replace(r.layout, offload_optimizer=False)
            assert max(s.total for s in estimate_stages(cfg, without)) > 0.9 * 40e9
            assert "optimizer in host memory" in r.reason(0.9 * 40e9)


def test_dry_run_shows_per_device_memory_with_offload(capsys):
    """megacann-train's entry point in-process (tests/test_dry_run.py starts the installed command)."""
    argv = [
        "--config",
        SEED_7B,
        "--dry_run",
        "optim.offload_optimizer=true",
        "training.activation_offload_layers=[0,1]",
    ]
    code = train_main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "-- memory per device" in out and "host  holds" in out
    assert "optimizer offload: fp32 masters, state and gradient staging in host memory" in out
    assert "activation offload: layers [0, 1] keep their saved activations in host memory" in out


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["training.activation_offload_layers=9"], "must be between 0 and model.num_layers (4), got 9"),
        (["training.activation_offload_layers=[1,1]"], "expected distinct layer indices in [0, 4)"),
        (["training.activation_offload_layers=[4]"], "([4] out of range)"),
        (["training.activation_offload_layers=true"], "expected int or list, got True (bool)"),
        (
            ["training.activation_offload_layers=1", "model.activation_checkpointing=full"],
            "cannot be used with model.activation_checkpointing 'full'",
        ),
        (["training.activation_offload_layers=1", "precision.compile=true"], "not supported with precision.compile"),
    ],
)
def test_offload_keys_are_checked(overrides, message):
    from training_helpers import tiny_config

    with pytest.raises(ConfigError) as err:
        tiny_config(overrides)
    assert message in str(err.value) and "training.activation_offload_layers" in str(err.value)
