"""The one answer to "what kind of weights directory is this" (megacann.interop.sources), which both
``model.init_from`` (the recipe's architecture) and the readers of weights (trainer, megacann-convert) use."""

import json
import os

import pytest

from megacann.checkpoint import CheckpointError
from megacann.checkpoint.files import COMPLETE_MARKER, LATEST_FILE
from megacann.checkpoint.metadata import FORMAT, FORMAT_VERSION
from megacann.config import ConfigError, MegacannConfig
from megacann.interop.model_source import apply_model_source, source_model_settings
from megacann.interop.names import CONSOLIDATED_CONFIG, HF_CONFIG, INFO_FILE
from megacann.interop.sources import CHECKPOINT, CONSOLIDATED, HUGGINGFACE, resolve_weight_source

SIZES = {"type": "llama", "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "vocab_size": 100}


def _write(path, name: str, value: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, name), "w") as f:
        json.dump(value, f)
    return str(path)


def _checkpoint(path) -> str:
    _write(path, INFO_FILE, {"format": FORMAT, "format_version": FORMAT_VERSION, "step": 4, "model": SIZES})
    open(os.path.join(path, COMPLETE_MARKER), "w").close()
    return str(path)


def test_each_kind_is_named(tmp_path):
    checkpoint = _checkpoint(tmp_path / "run" / "checkpoint_4")
    with open(tmp_path / "run" / LATEST_FILE, "w") as f:
        f.write("checkpoint_4\n")
    consolidated = _write(tmp_path / "consolidated", CONSOLIDATED_CONFIG, SIZES)
    hf = _write(tmp_path / "hf", HF_CONFIG, {"model_type": "llama"})
    assert resolve_weight_source(checkpoint).kind == CHECKPOINT
    output_dir = resolve_weight_source(str(tmp_path / "run"))
    assert (output_dir.kind, output_dir.path) == (CHECKPOINT, checkpoint)  # an output directory: its latest
    assert resolve_weight_source(consolidated).kind == CONSOLIDATED
    assert resolve_weight_source(hf).kind == HUGGINGFACE


def test_an_empty_or_missing_directory_is_refused_clearly(tmp_path):
    os.makedirs(tmp_path / "empty")
    with pytest.raises(CheckpointError, match=r"--base: .*empty' is neither a megacann checkpoint \(megacann.json\)"):
        resolve_weight_source(str(tmp_path / "empty"), "--base")
    with pytest.raises(CheckpointError, match=r"source: .*nowhere' is not a directory"):
        resolve_weight_source(str(tmp_path / "nowhere"), "source")
    with pytest.raises(ConfigError, match=r"model.init_from: .*empty' is neither"):
        source_model_settings(str(tmp_path / "empty"))


def test_model_init_from_fills_the_architecture_from_the_resolved_directory(tmp_path):
    _checkpoint(tmp_path / "run" / "checkpoint_4")
    consolidated = _write(tmp_path / "consolidated", CONSOLIDATED_CONFIG, {**SIZES, "hidden_size": 32})
    for source, hidden in ((str(tmp_path / "run"), 64), (consolidated, 32)):
        cfg = MegacannConfig()
        cfg.model.init_from = source
        apply_model_source(cfg)
        assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.vocab_size) == (hidden, 2, 100)


def test_a_recipe_taking_its_sizes_from_init_from_loads_then_prepares(tmp_path):
    from megacann.config import load_config
    from megacann.training.recipe import prepare_recipe

    consolidated = _write(tmp_path / "consolidated", CONSOLIDATED_CONFIG, SIZES)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{type: llama, init_from: {consolidated}}}\ndata: {{seq_length: 64}}\n")
    cfg = load_config(str(recipe))  # the sizes are not read yet: their checks wait for prepare_recipe
    assert cfg.model.hidden_size is None
    prepare_recipe(cfg, world_size=1, source=str(recipe))
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_attention_heads) == (64, 2, 4)
    with pytest.raises(ConfigError, match=r"model.hidden_size is not set"):
        load_config(str(recipe), ["model.init_from=null"])


def test_model_init_from_of_another_family_reads_that_family_keys(tmp_path):
    moe = _write(tmp_path / "moe", CONSOLIDATED_CONFIG, {**SIZES, "type": "moe", "num_experts": 4, "moe_top_k": 1})
    cfg = MegacannConfig()  # model.type left at its default
    cfg.model.init_from = moe
    apply_model_source(cfg)
    assert (cfg.model.type, cfg.model.num_experts, cfg.model.moe_top_k) == ("moe", 4, 1)
    assert type(cfg.model).__name__ == "MoEModelConfig"
