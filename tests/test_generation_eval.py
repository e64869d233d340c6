"""The recipe's ``generation_eval``: a tiny run logs the generation score and mean response length at
the steps it is due (every ``interval`` and the last), equal to what the generator gives on the run's
saved checkpoint; at tensor parallel 2 and data parallel 2 (each rank half the prompts) the logged
figures equal the one-process generator's on the checkpoint too. The built-in scorers score known texts;
a bad scorer, file or sampling value is refused in one line naming its key."""

from __future__ import annotations

import json
import os

import pytest
import torch
from dist_harness import run_on_ranks
from training_helpers import synthetic_data_factory, tiny_config

from megacann.config import ConfigError
from megacann.config.generation_eval import find_scorer

PROMPTS = ["abc", "hello wor", "x", "1 2 3 4", "the end is", "qq", "a longer prompt", "zz top"]
CACHE_ROWS, NEW_TOKENS, SEQ = 4, 6, 32  # 8 prompts in full batches of 4 on one rank and on each of 2
SCORER = '''
def spread(completion, record):
    """A score that moves with every character of the completion."""
    return sum(ord(c) * (i + 1) for i, c in enumerate(completion)) % 1009 / 1009 + len(record["prompt"])
'''


def write_inputs(root: str) -> tuple[str, str]:
    """(the prompts file, the scorer module) in ``root``."""
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"prompt": p, "answer": p[::-1]}) + "\n" for p in PROMPTS)
    module = os.path.join(root, "my_scorers.py")
    with open(module, "w") as f:
        f.write(SCORER)
    return prompts, module


def recipe(root: str, overrides: list[str] = (), world_size: int = 1, **section):
    prompts, module = write_inputs(root)
    settings = {"interval": 2, "prompts": prompts, "max_new_tokens": NEW_TOKENS, "batch_size": CACHE_ROWS}
    settings["scorer"] = "my_scorers:spread"
    return tiny_config(
        [f"experiment.output_dir={root}/run", "model.vocab_size=260", "logging.log_interval=5", *overrides],
        world_size=world_size,
        experiment={"imports": [module]},
        generation_eval={**settings, **section},
    )


def _train(root: str, overrides: list[str], world_size: int) -> tuple[int, int, int, int]:
    """Train; (tensor parallel size, data parallel size, rows of this rank's first q_proj, bytes of the
    generation cache last allocated)."""
    from megacann import parallel_state as ps
    from megacann.data.tokenizer import load_tokenizer
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    cfg = recipe(root, overrides, world_size)
    trainer = Trainer(
        cfg, setup_runtime(cfg), tokenizer=load_tokenizer("byte"), data_factory=synthetic_data_factory(cfg)
    )
    trainer.fit()
    q = next(p for n, p in trainer.model_chunks[0].named_parameters() if n.endswith("q_proj.weight"))
    sizes = ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size()
    return *sizes, q.shape[0], trainer.generation_eval.last_cache_bytes


def logged(root: str) -> dict[int, dict]:
    with open(os.path.join(root, "run", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r for r in records if "generation_score" in r}


def checkpoint_figures(root: str) -> tuple[float, float]:
    """The mean score and response length the generator gives on the run's last checkpoint, one process."""
    from megacann.data.tokenizer import load_tokenizer
    from megacann.generate import load_model
    from megacann.generation import Generator
    from megacann.models import get_model_spec
    from megacann.training.generation_eval import read_prompts, score_completions

    cfg = recipe(root)
    model = load_model(os.path.join(root, "run"))
    tokenizer = load_tokenizer("byte")
    generator = Generator(
        model, get_model_spec("llama"), eos_token_ids=[tokenizer.eos_id], pad_token_id=tokenizer.pad_id
    )
    records = read_prompts(cfg.generation_eval.prompts)
    scorer = find_scorer(cfg.generation_eval.scorer, cfg.experiment.imports)
    prompts = [tokenizer.encode(r["prompt"]) for r in records]
    score, length, count = score_completions(
        generator, tokenizer, records, prompts, list(range(len(records))), cfg.generation_eval, scorer
    )
    return score / count, length / count


def cache_formula(kv_heads_per_rank: int) -> int:
    """Keys and values of the tiny llama's 4 layers, head dim 16, fp32, for CACHE_ROWS rows of the longest
    prompt allowed (data.seq_length) plus the new tokens but the last."""
    return 2 * 4 * CACHE_ROWS * (SEQ + NEW_TOKENS - 1) * kv_heads_per_rank * 16 * 4


def test_a_run_logs_the_checkpoints_generation_score(tmp_path, capsys):
    root = str(tmp_path)
    assert _train(root, [], 1)[3] == cache_formula(2)  # the generator allocated what --dry_run reports
    records = logged(root)
    assert sorted(records) == [2, 4, 5]  # every 2 steps and the last (max_steps 5)
    score, length = checkpoint_figures(root)
    assert records[5]["generation_score"] == score
    assert records[5]["generation_length"] == length
    assert 0 < length <= 6
    assert len({records[s]["generation_score"] for s in records}) > 1  # the model changes, so does the score
    assert f"generation_score {score:.4f}" in capsys.readouterr().out  # the console line


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_at_the_training_layout(tmp_path, layout):
    root = str(tmp_path)
    overrides = ["distributed.tensor_parallel_size=2"] if layout == "tp2" else ["optim.grad_accum_steps=1"]
    probes = run_on_ranks(_train, 2, args=(root, overrides, 2), timeout=240)
    # the layout was in force: tp 2 halves q_proj's 64 rows on each rank; dp 2 keeps them whole
    expected = [(2, 1, 32, cache_formula(1))] * 2 if layout == "tp2" else [(1, 2, 64, cache_formula(2))] * 2
    assert probes == expected
    records = logged(root)
    assert sorted(records) == [2, 4, 5]
    score, length = checkpoint_figures(root)
    assert records[5]["generation_score"] == pytest.approx(score, rel=1e-12)
    assert records[5]["generation_length"] == length


@pytest.mark.parametrize("tp", [1, 2])
def test_dry_run_and_plan_print_the_cache_bytes(tmp_path, tp):
    from megacann.dry_run import describe
    from megacann.generation import kv_cache_bytes
    from megacann.planning import plan_report

    cfg = recipe(str(tmp_path), [f"distributed.tensor_parallel_size={tp}"], world_size=tp)
    expected = cache_formula(2 // tp)
    assert expected == kv_cache_bytes(4, CACHE_ROWS, SEQ + NEW_TOKENS - 1, 2 // tp, 16, torch.float32)
    line = f"generation_eval key/value cache per rank: {expected:,} bytes"
    assert line in describe(cfg)
    assert line in plan_report(cfg, None, tp, None)
    off = recipe(str(tmp_path), interval=0)
    assert "key/value cache" not in describe(off) + plan_report(off, None, 1, None)


def test_a_prompt_longer_than_the_sequence_is_refused(tmp_path):
    from megacann.data.tokenizer import load_tokenizer
    from megacann.models import get_model_spec
    from megacann.training.generation_eval import GenerationEval

    cfg = recipe(str(tmp_path), ["data.seq_length=9"])
    with pytest.raises(ValueError, match=r"prompt 5 has 10 tokens; expected 1 to data.seq_length \(9\)"):
        GenerationEval(cfg, load_tokenizer("byte"), get_model_spec("llama"))


def test_built_in_scorers():
    exact = find_scorer("exact_match", [])
    assert exact(" cba \n", {"answer": "cba"}) == 1.0
    assert exact("cb", {"answer": "cba"}) == 0.0
    regex = find_scorer(r"regex:answer is (\d+)", [])
    assert regex("so the answer is 42.", {"answer": "42"}) == 1.0
    assert regex("so the answer is 41.", {"answer": "42"}) == 0.0
    assert regex("no number", {"answer": "42"}) == 0.0
    assert find_scorer("regex:ab+", [])("xxabbby", {"answer": "abbb"}) == 1.0  # no group: the whole match


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"scorer": "nowhere:f"}, "generation_eval.scorer 'nowhere:f': module 'nowhere' is not in experiment.imports"),
        ({"scorer": "my_scorers:missing"}, "module 'my_scorers' has no function 'missing'"),
        ({"scorer": "regex:(a"}, r"generation_eval.scorer 'regex:\(a': not a regular expression"),
        ({"scorer": "exact"}, "generation_eval.scorer 'exact': expected one of exact_match, regex:<pattern>"),
        ({"prompts": "/nonexistent/p.jsonl"}, "generation_eval.prompts: file not found: '/nonexistent/p.jsonl'"),
        ({"top_p": 0.0}, r"generation_eval.top_p must be in \(0, 1\]"),
        ({"temperature": -1.0}, "generation_eval.temperature must be >= 0"),
        ({"max_new_tokens": 0}, "generation_eval.max_new_tokens must be >= 1"),
        ({"interval": -1}, "generation_eval.interval must be >= 0"),
    ],
)
def test_bad_settings_are_refused_by_key(tmp_path, setting, message):
    with pytest.raises(ConfigError, match=message):
        recipe(str(tmp_path), **setting)


def test_unknown_key_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'generation_eval.every'"):
        recipe(str(tmp_path), every=3)


def test_pipeline_stages_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="generation_eval needs the whole model on each rank"):
        recipe(str(tmp_path), ["distributed.pipeline_parallel_size=2"], world_size=2)


def test_a_prompts_line_without_a_prompt_is_named(tmp_path):
    from megacann.training.generation_eval import read_prompts

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    with pytest.raises(ValueError, match=rf'generation_eval.prompts {path}:2: expected an object with a "prompt"'):
        read_prompts(str(path))
