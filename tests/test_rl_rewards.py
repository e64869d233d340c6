"""The reward registry of reinforcement learning (rl.reward): the built-in rewards, a user's function found
through experiment.imports (a module's name or a .py file's stem), and the errors that name the record's
file and line when a reward raises, returns NaN or something not a number, or reads a missing field."""

from __future__ import annotations

import builtins
import sys

import pytest

from megacann.rl.rewards import RewardError, build_reward, score

WHERE = "prompts.jsonl:7"


def test_exact_match_compares_the_stripped_answer():
    reward = build_reward("exact_match", [])
    assert score(reward, "Reverse: abc", " cba\n", {"answer": "cba"}, WHERE) == 1.0
    assert score(reward, "Reverse: abc", "cb", {"answer": "cba"}, WHERE) == 0.0
    assert score(reward, "2 + 2", "4", {"answer": 4}, WHERE) == 1.0  # a number in the record: as a string


def test_math_reward_checks_the_answer_symbolically():
    pytest.importorskip("math_verify")
    reward = build_reward("math", [])
    assert score(reward, "Half of one?", "The answer is $\\frac{1}{2}$", {"answer": "0.5"}, WHERE) == 1.0
    assert score(reward, "6 x 7?", "so it is $42$", {"answer": "42"}, WHERE) == 1.0
    assert score(reward, "6 x 7?", "so it is $41$", {"answer": "42"}, WHERE) == 0.0


def test_math_reward_without_math_verify_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name.startswith("math_verify"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    with pytest.raises(RewardError, match=r"rl.reward math needs the package math-verify.*megacann\[math\]"):
        build_reward("math", [])


def test_regex_reward_is_a_format_reward():
    reward = build_reward(r"regex:(?s)^<think>.*</think>\s*\d+$", [])
    assert score(reward, "p", "<think>6 x 7</think> 42", {}, WHERE) == 1.0
    assert score(reward, "p", "42", {}, WHERE) == 0.0
    assert score(build_reward("regex:\\d", []), "p", "a1b", {}, WHERE) == 1.0  # search: anywhere
    with pytest.raises(RewardError, match=r"rl.reward regex:\(ab: not a regular expression"):
        build_reward("regex:(ab", [])


USER_REWARDS = """
def length_penalty(prompt, response, record):
    return -abs(len(response) - record["target"]) / 10

def explodes(prompt, response, record):
    raise RuntimeError("the judge is down")

def not_a_number(prompt, response, record):
    return float("nan")

def a_string(prompt, response, record):
    return "1.0"

def infinite(prompt, response, record):
    return float("inf")

def a_bool(prompt, response, record):
    return response == "yes"

LIMIT = 3
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return str(path)


def test_a_users_function_from_a_py_file_named_in_imports(user_file):
    reward = build_reward("my_rewards:length_penalty", ["some_other_module", user_file])
    assert score(reward, "p", "abcde", {"target": 3}, WHERE) == pytest.approx(-0.2)
    assert score(build_reward("my_rewards:a_bool", [user_file]), "p", "yes", {}, WHERE) == 1.0


def test_a_users_function_from_a_module_name(tmp_path, monkeypatch):
    (tmp_path / "scorer_pkg_rl.py").write_text("def exact(prompt, response, record):\n    return 0.25\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = build_reward("scorer_pkg_rl:exact", ["scorer_pkg_rl"])
    assert score(reward, "p", "r", {}, WHERE) == 0.25
    sys.modules.pop("scorer_pkg_rl", None)


def test_a_function_not_found_is_named(user_file):
    with pytest.raises(
        RewardError,
        match=r"rl.reward 'my_rewards:missing': module my_rewards \(.*my_rewards.py\) has no function 'missing'",
    ):
        build_reward("my_rewards:missing", [user_file])
    with pytest.raises(RewardError, match=r"my_rewards.LIMIT is a int, not a function"):
        build_reward("my_rewards:LIMIT", [user_file])
    with pytest.raises(
        RewardError,
        match=r"no module 'nowhere_rl_module': not importable, and experiment.imports \(.*my_rewards.py\) names no nowhere_rl_module.py",
    ):
        build_reward("nowhere_rl_module:f", [user_file])
    with pytest.raises(
        RewardError, match=r"not a built-in reward \(exact_match, math, regex:<pattern>\) nor module:function"
    ):
        build_reward("exact", [])


@pytest.mark.parametrize(
    "function, message",
    [
        ("explodes", r"prompts.jsonl:7: reward explodes raised RuntimeError: the judge is down"),
        ("not_a_number", r"prompts.jsonl:7: reward not_a_number returned nan, expected a finite float"),
        ("infinite", r"prompts.jsonl:7: reward infinite returned inf, expected a finite float"),
        ("a_string", r"prompts.jsonl:7: reward a_string returned str '1.0', expected a float"),
    ],
)
def test_a_failing_reward_names_the_record(user_file, function, message):
    reward = build_reward(f"my_rewards:{function}", [user_file])
    with pytest.raises(RewardError, match=message):
        score(reward, "p", "r", {"answer": "x"}, WHERE)


def test_a_missing_field_is_named_with_the_records_fields(user_file):
    with pytest.raises(
        RewardError,
        match=r"prompts.jsonl:7: reward exact_match reads the field 'answer', which this record lacks \(it has: prompt, question\)",
    ):
        score(build_reward("exact_match", []), "p", "r", {"prompt": "p", "question": "q"}, WHERE)
    with pytest.raises(RewardError, match=r"prompts.jsonl:7: reward length_penalty reads the field 'target'"):
        score(build_reward("my_rewards:length_penalty", [user_file]), "p", "r", {}, WHERE)
