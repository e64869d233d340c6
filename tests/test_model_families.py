"""Family-owned configuration: a family declares its own model keys, every process that reads a recipe
knows the family (``experiment.imports``), and the launcher hands a script's family to its ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml
from cli_helpers import ROOT, console_script, user_env
from dist_harness import run_on_ranks

from megacann.config import ConfigError, load_config, shape_keys

# A family megacann does not ship, declaring a key of its own, written where a user would keep it.
WIDE_FAMILY = textwrap.dedent(
    """
    from dataclasses import dataclass, field
    from typing import ClassVar

    from megacann.config import ModelConfig
    from megacann.models import LLAMA, HFAdapter, register_model


    @dataclass
    class WideConfig(ModelConfig):
        HF_KEYS: ClassVar[dict] = {**ModelConfig.HF_KEYS, "hf_wide_factor": "wide_factor"}
        type: str = "wide_lm"
        wide_factor: int = field(default=2, metadata={"shape": True})
        wide_mode: str = field(default="sum", metadata={"choices": ("sum", "max")})


    def _unused(*args):
        raise AssertionError("not called by these tests")


    register_model(
        LLAMA.__class__(
            name="wide_lm",
            build_chunk=LLAMA.build_chunk,
            flops_per_token=LLAMA.flops_per_token,
            fill_defaults=LLAMA.fill_defaults,
            config_class=WideConfig,
            hf=HFAdapter(("wide",), _unused, _unused, _unused, _unused),
        )
    )
    """
)
SIZES = {"hidden_size": 32, "num_layers": 2, "num_attention_heads": 4}


@pytest.fixture(scope="module")
def family_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("family") / "wide_family.py"
    path.write_text(WIDE_FAMILY)
    return str(path)


def _recipe(tmp_path, family_file, model: dict, name: str = "r.yaml") -> str:
    path = tmp_path / name
    recipe = {"experiment": {"imports": [family_file]}, "model": model, "data": {"seq_length": 32}}
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_a_family_reads_its_own_key_from_yaml(tmp_path, family_file):
    cfg = load_config(_recipe(tmp_path, family_file, {"type": "wide_lm", "wide_factor": 4, **SIZES}))
    assert type(cfg.model).__name__ == "WideConfig" and cfg.model.wide_factor == 4
    assert cfg.experiment.imports == [family_file]
    assert "wide_factor" in shape_keys(cfg.model)  # a resume with another width is refused like a hidden size
    overridden = load_config(_recipe(tmp_path, family_file, {"type": "wide_lm", **SIZES}), ["model.wide_factor=8"])
    assert overridden.model.wide_factor == 8


def test_a_family_reads_its_own_key_from_config_json(tmp_path, family_file):
    hf = {"model_type": "wide", "hf_wide_factor": 5, "hidden_size": 32, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    model = {"config_path": "config.json", "num_attention_heads": 4}
    cfg = load_config(_recipe(tmp_path, family_file, model))  # the family comes from config.json's model_type
    assert cfg.model.type == "wide_lm" and cfg.model.wide_factor == 5 and cfg.model.num_layers == 2


def test_a_misspelt_family_key_is_refused_with_a_suggestion(tmp_path, family_file):
    misspelt = _recipe(tmp_path, family_file, {"type": "wide_lm", "wide_factr": 3, **SIZES})
    with pytest.raises(
        ConfigError, match=r"r.yaml: unknown key 'model.wide_factr'; did you mean 'model.wide_factor'\?"
    ):
        load_config(misspelt)
    good = _recipe(tmp_path, family_file, {"type": "wide_lm", **SIZES}, "good.yaml")
    with pytest.raises(ConfigError, match=r"unknown key 'model.wide_factr'; did you mean 'model.wide_factor'\?"):
        load_config(good, ["model.wide_factr=3"])
    with pytest.raises(ConfigError, match=r"model.wide_mode: 'avg' is not one of sum, max"):
        load_config(good, ["model.wide_mode=avg"])


def test_a_key_of_another_family_is_named_as_such(tmp_path, family_file):
    llama = _recipe(tmp_path, family_file, {"type": "llama", "wide_factor": 3, **SIZES})
    with pytest.raises(
        ConfigError, match=r"'model.wide_factor' for model.type 'llama': it is a key of model family 'wide_lm'"
    ):
        load_config(llama)
    # switching family on the command line carries the shared keys and opens the new family's own
    cfg = load_config(_recipe(tmp_path, family_file, {**SIZES}), ["model.num_experts=4", "model.type=moe"])
    assert cfg.model.type == "moe" and cfg.model.num_experts == 4 and cfg.model.hidden_size == 32
    moe = _recipe(tmp_path, family_file, {"type": "moe", "num_experts": 4, **SIZES}, "moe.yaml")
    with pytest.raises(ConfigError, match=r"model.num_experts is a key of model family 'moe', not of 'llama'"):
        load_config(moe, ["model.type=llama"])


def test_an_unknown_family_says_how_to_make_it_known(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"type": "nope_lm", **SIZES}}))
    with pytest.raises(
        ConfigError,
        match=r"model.type 'nope_lm' is not a registered model family; registered: .*llama.*experiment.imports",
    ):
        load_config(str(path))
    path.write_text(yaml.safe_dump({"experiment": {"imports": ["no_such_module_here"]}}))
    with pytest.raises(
        ConfigError, match=r"experiment.imports: importing 'no_such_module_here' failed: ModuleNotFoundError"
    ):
        load_config(str(path))
    path.write_text(yaml.safe_dump({"experiment": {"imports": ["missing/family.py"]}}))
    with pytest.raises(ConfigError, match=r"experiment.imports: file not found: 'missing/family.py'"):
        load_config(str(path))


def _family_read_afresh(whole: str) -> str:
    """In a process that never imported the script (forked from the test harness's server): the family
    of a consolidated directory, which its model_config.json makes known."""
    from megacann.interop.reading import read_consolidated
    from megacann.models import registered_models

    assert "parallel_lm" not in registered_models()
    return read_consolidated(whole)[1].type


def test_a_script_family_reaches_every_rank_and_the_converter(tmp_path):
    """examples/custom_model.py at tp 2 through the launcher, from a recipe that does not name the script:
    the launcher hands the ranks its module; the checkpoint records it, so megacann-convert knows the
    family in a process of its own."""
    with open(os.path.join(ROOT, "examples", "configs", "custom", "tiny.yaml")) as f:
        recipe = yaml.safe_load(f)
    del recipe["experiment"]["imports"]
    recipe["experiment"]["output_dir"] = str(tmp_path / "run")
    recipe["model"].update(
        hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=128
    )
    recipe["data"].update(seq_length=32, batch_size=4)
    recipe["optim"]["max_steps"] = 4
    recipe["logging"].update(log_interval=1, eval_interval=0, ckpt_interval=0)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(recipe))
    script = os.path.join(ROOT, "examples", "custom_model.py")
    layout = ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"]
    cmd = [sys.executable, script, "--config", str(tmp_path / "tiny.yaml"), "--nproc_per_node", "2", *layout]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=user_env(), timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = tmp_path / "run"
    info = json.loads((run / "checkpoint_4" / "megacann.json").read_text())
    assert info["model"]["type"] == "parallel_lm" and info["imports"] == [os.path.abspath(script)]
    assert info["layout"]["tensor_parallel_size"] == 2
    out = tmp_path / "whole"
    conv = subprocess.run(
        [console_script("megacann-convert"), "consolidate", str(run), str(out)],
        capture_output=True, text=True, env=user_env(), timeout=300, cwd=str(tmp_path),
    )  # fmt: skip
    assert conv.returncode == 0, conv.stdout[-2000:] + conv.stderr[-3000:]
    assert json.loads((out / "model_config.json").read_text())["imports"] == [os.path.abspath(script)]
    assert run_on_ranks(_family_read_afresh, 1, args=(str(out),), init_process_group=False) == ["parallel_lm"]
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}  # whole tensors, not tp shards
    assert shapes["layers.0.self_attn.q_proj.weight"] == (64, 64) and shapes["layers.1.self_attn.k_proj.weight"] == (
        32,
        64,
    )
    assert shapes["layers.1.mlp.gate_up_proj.weight"] == (2 * 128, 64) and shapes["embed_tokens.weight"][1] == 64


def test_an_installed_package_announces_its_families(tmp_path):
    """A package that declares the entry point group megacann.model_families is found without
    experiment.imports (what a pip-installed family package does)."""
    site = tmp_path / "site"
    (site / "wide_pkg").mkdir(parents=True)
    (site / "wide_pkg" / "__init__.py").write_text(WIDE_FAMILY)
    dist = site / "wide_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: wide-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[megacann.model_families]\nwide = wide_pkg\n")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"model": {"type": "wide_lm", "wide_factor": 6, **SIZES}}))
    code = "from megacann.config import load_config; print(load_config('r.yaml').model.wide_factor)"
    env = user_env({"PYTHONPATH": str(site)})
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "6"


def test_a_rival_family_of_a_registered_name_is_refused():
    import dataclasses

    from megacann.models import LLAMA, register_model

    with pytest.raises(ValueError, match=r"a model family named 'llama' is already registered \(pass replace=True\)"):
        register_model(dataclasses.replace(LLAMA, num_parameters=None))


def test_one_map_from_hugging_face_model_type_to_family():
    """The recipe loader and the weights import read the same map: every readable model_type finds its
    family through both, a second family claiming a taken model_type is refused, an unknown one names
    what is readable."""
    import dataclasses

    from megacann.config.families import family_of_hf_model_type, hf_model_types
    from megacann.models import LLAMA, find_hf_family, register_model, registered_models

    readable = hf_model_types()
    assert {"llama", "mixtral", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"} <= set(readable)
    for model_type in readable:
        assert find_hf_family(model_type).name == family_of_hf_model_type(model_type)
    rival = dataclasses.replace(LLAMA, name="llama_rival")
    with pytest.raises(ValueError, match=r"model_type 'llama' is already read by family 'llama'"):
        register_model(rival)
    assert "llama_rival" not in registered_models() and family_of_hf_model_type("llama") == "llama"
    with pytest.raises(ConfigError, match=r"model_type 'gpt_neox' has no megacann adapter; readable: deepseek_v3, "):
        find_hf_family("gpt_neox")
