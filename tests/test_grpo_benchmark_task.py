"""The reversal task that ``benchmarks/grpo_vs_trl.py --learn`` trains both libraries on
(``benchmarks/grpo_learning.py``): GRPO prompts are the text SFT puts before the answer, the held-out
words are not trained on, and the reward curve's windows."""

import importlib.util
import json
import os

from megacann.data.sft import parse_record
from megacann.data.sft_templates import get_template
from megacann.rl.rewards import exact_match

HERE = os.path.dirname(os.path.abspath(__file__))


def _learning_module():
    path = os.path.join(os.path.dirname(HERE), "benchmarks", "grpo_learning.py")
    spec = importlib.util.spec_from_file_location("grpo_learning", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_prompts_are_the_sft_text_before_the_answer_and_test_words_are_unseen(tmp_path):
    paths = _learning_module().write_task(
        str(tmp_path), train=5000, test=200, seed=3
    )  # enough 3-letter words to collide
    sft, prompts, test = (_read(paths[k]) for k in ("sft", "prompts", "test"))
    assert len(sft) == len(prompts) == 5000 and len(test) == 200
    template = get_template("plain")
    for record, prompt in zip(sft, prompts):
        (before, _), (answer, trained) = template.render(parse_record(record))
        assert prompt["prompt"] == before and answer == prompt["answer"] and trained
        word = record["instruction"].removeprefix("Reverse: ")
        assert record["output"] == word[::-1] and 3 <= len(word) <= 5
        assert exact_match(prompt["prompt"], f" {word[::-1]}\n", prompt) == 1.0
    trained_words = {r["instruction"] for r in sft}
    assert len(trained_words) == 5000 and not trained_words & {r["instruction"] for r in test}


def test_reward_curve_means_each_window():
    curve = _learning_module().curve
    assert curve([0.0, 1.0, 0.5, 0.5, 1.0], 2) == [0.5, 0.5, 1.0]
    assert curve([0.25] * 4, 10) == [0.25]
