"""Recipe loading, overrides and validation."""

import json
import os
import textwrap

import pytest

from megacann.config import ConfigError, apply_overrides, config_from_dict, load_config, validate
from megacann.training.recipe import prepare_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = os.path.join(ROOT, "examples", "configs", "llama", "llama_7b.yaml")


def write(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


TINY = """
model: {type: llama, hidden_size: 64, num_layers: 4, num_attention_heads: 4, vocab_size: 100}
data: {seq_length: 32, batch_size: 2}
"""


def test_seed_recipe_loads_unchanged():
    cfg = load_config(SEED)
    assert cfg.experiment.name == "llama_7b_pretrain"
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.ffn_size) == (4096, 32, 11008)
    assert cfg.model.vocab_size == 32000 and cfg.model.precision == "bf16"
    assert cfg.optim.lr == 3.0e-4 and cfg.optim.warmup_ratio == 0.03
    d = cfg.distributed
    assert (d.world_size, d.tensor_parallel_size, d.pipeline_parallel_size, d.data_parallel_size) == (32, 4, 4, 2)
    assert d.zero_stage == 1
    assert cfg.global_batch_size == 128
    assert cfg.logging.keep_last == 3


def test_unknown_key_names_file_and_closest_key(tmp_path):
    path = write(tmp_path, TINY + "optim: {learning_rate: 0.001}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert path in msg and "optim.learning_rate" in msg and "did you mean 'optim.lr'" in msg


def test_typo_suggests_close_key(tmp_path):
    path = write(tmp_path, TINY + "logging: {log_intervl: 5}\n")
    with pytest.raises(ConfigError, match="did you mean 'logging.log_interval'"):
        load_config(path)


def test_unknown_section(tmp_path):
    path = write(tmp_path, TINY + "optimizer: {lr: 0.1}\n")
    with pytest.raises(ConfigError, match="unknown key 'optimizer'.*did you mean 'optim"):
        load_config(path)


def test_overrides_convert_types(tmp_path):
    path = write(tmp_path, TINY)
    cfg = load_config(
        path,
        [
            "optim.lr=3e-4",
            "optim.max_steps=7",
            "seed=7",
            "distributed.sequence_parallel=true",
            "distributed.zero_optimization=2",
            "experiment.name=run7",
            "data.path=[a, b]",
            "model.num_hidden_layers=2",
        ],
    )
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.optim.max_steps == 7 and cfg.seed == 7 and cfg.distributed.sequence_parallel is True
    assert cfg.distributed.zero_stage == 2 and cfg.experiment.name == "run7"
    assert cfg.data.path == ["a", "b"] and cfg.model.num_layers == 2


def test_override_errors(tmp_path):
    path = write(tmp_path, TINY)
    with pytest.raises(ConfigError, match="did you mean 'optim.lr'"):
        load_config(path, ["optim.learning_rate=0.1"])
    with pytest.raises(ConfigError, match=r"optim.max_steps: expected int, got 'many'"):
        load_config(path, ["optim.max_steps=many"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(path, ["optim.lr"])


def test_wrong_type_in_file(tmp_path):
    path = write(tmp_path, TINY + "optim: {grad_accum_steps: 2.5}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert path in str(err.value) and "optim.grad_accum_steps: expected int, got 2.5" in str(err.value)


@pytest.mark.parametrize(
    "extra,pattern",
    [
        (
            "distributed: {world_size: 8, tensor_parallel_size: 2, pipeline_parallel_size: 2, data_parallel_size: 4}",
            r"world_size 8 != tensor_parallel_size 2 x pipeline_parallel_size 2 x data_parallel_size 4.* = 16",
        ),
        ("distributed: {tensor_parallel_size: 3}", "num_attention_heads 4 is not divisible by.*tensor_parallel_size 3"),
        ("distributed: {pipeline_parallel_size: 3}", "num_layers 4 is not divisible by pipeline_parallel_size 3"),
        (
            "distributed: {pipeline_parallel_size: 2, virtual_pipeline_size: 4}",
            r"num_layers 4 is not divisible by pipeline_parallel_size 2 x virtual_pipeline_size 4 = 8",
        ),
        ("distributed: {parallel_mode: data, tensor_parallel_size: 2}", "parallel_mode 'data' needs"),
        ("distributed: {parallel_mode: tensor, pipeline_parallel_size: 2}", "parallel_mode 'tensor' needs"),
        ("distributed: {parallel_mode: pipeline, tensor_parallel_size: 2}", "parallel_mode 'pipeline' needs"),
        ("optim: {scheduler: step}", "optim.scheduler: 'step' is not one of cosine, linear, constant"),
        ("distributed: {zero_optimization: 4}", "zero_optimization must be false, true, 1, 2 or 3, got 4"),
    ],
)
def test_validation_errors(tmp_path, extra, pattern):
    path = write(tmp_path, TINY + extra + "\n")
    with pytest.raises(ConfigError, match=pattern):
        prepare_recipe(load_config(path))  # the recipe's own rules, the model family's and the pipeline's


def test_kv_heads_must_divide_or_be_multiple_of_tp():
    raw = {"model": {"hidden_size": 96, "num_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 3}}
    cfg = config_from_dict(raw)
    with pytest.raises(ConfigError, match="num_key_value_heads 3 must be a multiple or a divisor of.*size 2"):
        cfg.distributed.tensor_parallel_size = 2
        validate(cfg)
    cfg = config_from_dict({**raw, "distributed": {"tensor_parallel_size": 4}})
    with pytest.raises(ConfigError, match="num_key_value_heads 3"):
        validate(cfg)
    raw["model"]["ffn_hidden_size"] = 192
    validate(config_from_dict({**raw, "distributed": {"tensor_parallel_size": 3}}))  # kv heads == tp
    validate(config_from_dict({**raw, "distributed": {"tensor_parallel_size": 6}}))  # kv replicated
    raw["model"]["num_key_value_heads"] = 2
    validate(config_from_dict({**raw, "distributed": {"tensor_parallel_size": 4}}))  # kv replicated


def test_runtime_world_size_fills_data_parallel(tmp_path):
    path = write(tmp_path, TINY + "distributed: {tensor_parallel_size: 2}\noptim: {grad_accum_steps: 3}\n")
    cfg = load_config(path, world_size=8)
    assert cfg.distributed.data_parallel_size == 4 and cfg.distributed.world_size == 8
    assert cfg.global_batch_size == 2 * 4 * 3
    path = write(tmp_path, TINY + "distributed: {world_size: 4}\n", "w.yaml")
    with pytest.raises(ConfigError, match="world_size is 4 but 2 processes were started"):
        load_config(path, world_size=2)


def test_hf_config_json_merges_and_inline_wins(tmp_path):
    (tmp_path / "m.json").write_text(
        json.dumps(
            {
                "hidden_size": 128,
                "num_hidden_layers": 6,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "intermediate_size": 344,
                "vocab_size": 500,
                "rms_norm_eps": 1e-6,
                "rope_theta": 500000.0,
                "max_position_embeddings": 256,
                "tie_word_embeddings": True,
                "model_type": "llama",
                "torch_dtype": "bfloat16",
            }
        )
    )
    path = write(tmp_path, "model: {config_path: m.json, num_layers: 2}\ndata: {seq_length: 256}\n")
    cfg = load_config(path)
    m = cfg.model
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.kv_heads) == (128, 2, 8, 2)
    assert (m.ffn_size, m.vocab_size, m.norm_eps, m.rope_theta) == (344, 500, 1e-6, 500000.0)
    assert m.tie_word_embeddings is True and m.max_position_embeddings == 256
    assert os.path.isabs(m.config_path)


def test_a_head_width_the_family_cannot_hold_is_refused_not_ignored(tmp_path):
    hf = {"model_type": "llama", "hidden_size": 128, "num_attention_heads": 8, "num_hidden_layers": 2}
    (tmp_path / "m.json").write_text(json.dumps({**hf, "head_dim": 16}))  # 128 / 8: the width llama has
    assert load_config(write(tmp_path, "model: {config_path: m.json}\n")).model.hidden_size == 128
    (tmp_path / "m.json").write_text(json.dumps({**hf, "head_dim": 32}))
    with pytest.raises(ConfigError, match=r"m.json: head_dim 32 is not hidden_size 128 / num_attention_heads 8"):
        load_config(write(tmp_path, "model: {config_path: m.json}\n"))
    (tmp_path / "m.json").write_text(json.dumps({**hf, "model_type": "mistral", "head_dim": 32}))
    assert load_config(write(tmp_path, "model: {config_path: m.json}\n")).model.head_dim == 32  # mistral reads it


def test_missing_config_path_names_it(tmp_path):
    path = write(tmp_path, "model: {config_path: nowhere.json}\n")
    with pytest.raises(ConfigError, match="model.config_path: file not found: 'nowhere.json'"):
        load_config(path)


def test_resolved_recipe_round_trips(tmp_path):
    cfg = load_config(SEED)
    again = config_from_dict(__import__("yaml").safe_load(cfg.to_yaml()))
    validate(again)
    assert again == cfg
    assert apply_overrides(again, ["seed=5"]).seed == 5
