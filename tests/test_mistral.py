"""The Mistral family: logits equal transformers' ``MistralForCausalLM`` (eager attention, a sliding window
shorter than the sequence, heads wider than hidden / heads) after from_pretrained_hf, and a model written
back (``save_pretrained_hf``, ``megacann-convert from-hf`` then ``to-hf``) loads in transformers with the
same logits and tensors; a trainer started with ``model.init_from`` of the directory has its logits
too; the Mistral-7B recipe counts the parameters of transformers' Mistral-7B config;
what is not Mistral is refused by name; the tiny recipe's loss trace at cp 2 (ring, all-gather, Ulysses)
and at tp 2 with sequence parallelism equals one process (fp32, relative 1e-5), each mode really on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_harness import run_on_ranks

from megacann.config import ConfigError, load_config
from megacann.interop.hf import from_pretrained_hf, save_pretrained_hf
from megacann.models import MISTRAL, MistralModelConfig, prepare_model_config
from megacann.models.hf_mistral import hf_config_dict

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "configs" / "mistral"
VOCAB, WINDOW, HEAD_DIM = 300, 5, 24


def tiny_hf_mistral(path: str, seed: int = 0, **settings) -> str:
    """A tiny Mistral written by transformers (norms randomised so a test sees them)."""
    import transformers

    cfg = transformers.MistralConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": HEAD_DIM,  # not 64 / 4
            "sliding_window": WINDOW,
            "max_position_embeddings": 64,
            "rope_theta": 50000.0,
            "attn_implementation": "eager",
            **settings,
        }
    )
    torch.manual_seed(seed)
    model = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def test_mistral_logits_parity_both_ways_and_through_convert(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megacann.convert import main as convert

    tiny_hf_mistral(str(tmp_path / "hf"))
    reference = transformers.MistralForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    ours = from_pretrained_hf(str(tmp_path / "hf")).eval()
    m = ours.config
    assert (m.type, m.sliding_window, m.head_dim) == ("mistral", WINDOW, HEAD_DIM)
    assert ours.layers["0"].self_attn.sliding_window == WINDOW
    with torch.no_grad():
        logits = ours(input_ids=ids)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    with torch.no_grad():  # the window is really on: without it the logits differ
        ours.layers["0"].self_attn.sliding_window = ours.layers["1"].self_attn.sliding_window = None
        assert (ours(input_ids=ids) - expected).abs().max() > 1e-2
        ours.layers["0"].self_attn.sliding_window = ours.layers["1"].self_attn.sliding_window = WINDOW

    save_pretrained_hf([ours], str(tmp_path / "back"), ours.config)
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (written["model_type"], written["sliding_window"], written["head_dim"]) == ("mistral", WINDOW, HEAD_DIM)
    assert convert(["from-hf", str(tmp_path / "hf"), str(tmp_path / "whole")]) == 0
    assert convert(["to-hf", str(tmp_path / "whole"), str(tmp_path / "converted")]) == 0
    for out in ("back", "converted"):
        again = transformers.MistralForCausalLM.from_pretrained(tmp_path / out, attn_implementation="eager").eval()
        with torch.no_grad():
            torch.testing.assert_close(again(ids).logits, expected, atol=1e-4, rtol=0)
        for name, p in reference.state_dict().items():
            assert torch.equal(again.state_dict()[name], p), (out, name)


def test_mistral_7b_recipe_counts_transformers_mistral_7b():
    transformers = pytest.importorskip("transformers")
    cfg = load_config(str(RECIPES / "mistral_7b.yaml"))
    prepare_model_config(cfg)
    m = cfg.model
    hf = transformers.MistralConfig(  # Mistral-7B-v0.1's config.json
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=4096,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        expected = sum(p.numel() for p in transformers.MistralForCausalLM(hf).parameters())
    assert expected == 7_241_732_096
    assert MISTRAL.total_parameters(m) == expected
    from megacann.dry_run import describe

    assert f"{expected:,} parameters" in describe(cfg, "mistral_7b.yaml")
    assert (m.sliding_window, m.head_dim) == (hf.sliding_window, hf.head_dim)


def test_what_mistral_cannot_express_is_refused(tmp_path):
    from training_helpers import tiny_config

    for key, value in (("sliding_window", 0), ("head_dim", -8)):
        with pytest.raises(ConfigError, match=rf"model.{key} must be a positive integer or null, got {value}"):
            tiny_config(["model.type=mistral", f"model.{key}={value}"])
    biased = MistralModelConfig(hidden_size=32, num_layers=1, num_attention_heads=4, add_bias_linear=True)
    with pytest.raises(ConfigError, match=r"model.add_bias_linear True cannot be written as Mistral"):
        hf_config_dict(biased, torch.float32)
    with pytest.raises(
        ConfigError,
        match=r"'model.sliding_window' for model.type 'llama': it is a key of model family 'deepseek_v4' / 'gpt_oss' / 'mistral'",
    ):
        tiny_config(["model.sliding_window=8"])
    config = tmp_path / "config.json"  # a LLaMA checkpoint with a window is still refused
    config.write_text('{"model_type": "llama", "sliding_window": 4096}')
    from megacann.models.hf_llama import model_config_from_hf

    with pytest.raises(ConfigError, match=r"sliding_window 4096 is not supported \(only None\)"):
        model_config_from_hf(str(config))


def test_the_memory_planner_plans_mistral_at_any_head_width():
    from megacann.models.sizing import layer_parameters
    from megacann.planning.formulas import architecture, layer_parameters_per_rank

    cfg = load_config(str(RECIPES / "mistral_7b.yaml"))
    prepare_model_config(cfg)
    assert architecture(cfg.model) is MISTRAL.architecture  # head_dim 128 = 4096 / 32
    tiny = load_config(str(RECIPES / "tiny.yaml"))  # head_dim 48, hidden / heads 32
    prepare_model_config(tiny)
    assert layer_parameters_per_rank(tiny.model, 1) == (layer_parameters(tiny.model, MISTRAL.architecture), 0)


# -- parallel layouts ----------------------------------------------------------------------------------

STEPS, S = 3, 32
MISTRAL_TINY = ["model.type=mistral", f"model.head_dim={HEAD_DIM}", f"model.sliding_window={WINDOW}"]
CP2 = "distributed.context_parallel_size=2"
LAYOUTS = {
    "cp2_ring": [CP2],
    "cp2_allgather": [CP2, "distributed.context_parallel_algo=allgather"],
    "cp2_ulysses": [CP2, "distributed.context_parallel_algo=ulysses"],
    "tp2_sp": ["distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
}


def _runs(layouts: dict, root: str) -> dict:
    from test_context_parallel_training import _train, _trainer

    return {name: _train(_trainer(MISTRAL_TINY + o, f"{root}/{name}", STEPS), STEPS) for name, o in layouts.items()}


def _init_from_logits_diff(hf_dir: str, out: str) -> float:
    """Largest logit difference between transformers and a trainer started with ``model.init_from``."""
    import transformers
    from finetune_helpers import chunk_logits, recipe
    from training_helpers import synthetic_data_factory

    from megacann import parallel_state as ps
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    ps.destroy_model_parallel()
    cfg = recipe(
        [f"experiment.output_dir={out}", f"model.init_from={hf_dir}", "data.tokenizer=byte"],
        {"type": "mistral", "precision": "fp32"},
    )
    assert (cfg.model.sliding_window, cfg.model.head_dim) == (WINDOW, HEAD_DIM)  # filled from config.json
    trainer = Trainer(cfg, setup_runtime(cfg), data_factory=synthetic_data_factory(cfg))
    theirs = transformers.MistralForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return float((chunk_logits(trainer, ids) - theirs(ids).logits).abs().max())


def _one_process(root: str, hf_dir: str) -> dict:
    return {**_runs({"one": []}, root), "init_from_diff": _init_from_logits_diff(hf_dir, f"{root}/init_from")}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mistral_layouts"))
    hf_dir = tiny_hf_mistral(f"{root}/hf")
    one = run_on_ranks(_one_process, 1, args=(root, hf_dir), timeout=300)[0]
    return one, run_on_ranks(_runs, 2, args=(LAYOUTS, root), timeout=600)[0]


@pytest.mark.extended
def test_init_from_a_hugging_face_mistral_gives_its_logits(traces):
    assert traces[0]["init_from_diff"] < 1e-4


@pytest.mark.extended
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mistral_layouts_train_like_one_process(traces, layout):
    from test_training_parity import assert_close_trace, assert_params_close

    ref, got = traces[0]["one"], traces[1][layout]
    assert_close_trace(got["losses"], ref["losses"], 1e-5)
    assert_close_trace(got["norms"], ref["norms"], 1e-5)
    assert_params_close(got["grads"], ref["grads"], 1e-5)
    # each mode was on: the first layer's tokens per rank, and the algorithm of every cp attention call
    assert ref["layer_tokens"] == [S] and ref["attention"] == []
    if layout.startswith("cp2"):
        assert got["layer_tokens"] == [S // 2] and got["attention"] == [(layout.split("_")[1], S // 2, False)]
    else:
        assert got["layer_tokens"] == [S // 2] and got["attention"] == []
