"""The reward registry: what ``rl.reward`` names, turned into a function scoring one response.

A reward function is called as ``fn(prompt, response, record) -> float``; ``record`` is the prompt's line
of the prompts file, with whatever fields the reward reads (``answer``, say). :func:`build_reward` knows:

- ``exact_match``: 1.0 when the response, stripped, equals ``record["answer"]`` (as a string, stripped);
- ``math``: 1.0 when the response's final mathematical answer equals ``record["answer"]``, checked by
  ``math-verify`` (parsing LaTeX and plain numbers, symbolic comparison), the optional extra ``math``;
- ``regex:<pattern>``: 1.0 when ``re.search(pattern, response)`` matches (a format reward: anchor it with
  ``^...$`` and ``(?s)`` to ask for a whole layout, e.g. ``regex:(?s)^<think>.*</think>.*$``);
- ``module:function``: a user's function, ``module`` being a module named in ``experiment.imports`` or
  the stem of a ``.py`` file named there (or any importable module).

:func:`score` calls a reward and names the record (``file:line``) in a :class:`RewardError` when the function
raises, reads a field the record lacks, or returns something that is not a finite number.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, Callable

from megacann.config.families import import_family_modules

RewardFn = Callable[[str, str, dict], float]
BUILT_INS = ("exact_match", "math", "regex:<pattern>")
MATH_EXTRA_HINT = "pip install 'megacann[math]' (or pip install math-verify)"


class RewardError(ValueError):
    """A reward that cannot be built, or that failed on a record (the message names the record)."""


def exact_match(prompt: str, response: str, record: dict) -> float:
    """1.0 when the stripped response equals the record's ``answer`` (stripped), else 0.0."""
    return float(response.strip() == str(record["answer"]).strip())


def _math_reward() -> RewardFn:
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise RewardError(f"rl.reward math needs the package math-verify, absent here: {MATH_EXTRA_HINT}") from err

    def math_answer(prompt: str, response: str, record: dict) -> float:
        """1.0 when math-verify finds the response's answer equal to the record's ``answer``."""
        gold = parse(str(record["answer"]))
        return float(bool(gold) and verify(gold, parse(response)))

    return math_answer


def _regex_reward(pattern: str) -> RewardFn:
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise RewardError(f"rl.reward regex:{pattern}: not a regular expression ({err})") from err

    def regex_match(prompt: str, response: str, record: dict) -> float:
        return float(compiled.search(response) is not None)

    return regex_match


def _module_of_file(path: str) -> Any:
    """The module loaded from the ``.py`` file ``path`` (imported now if it was not)."""
    import_family_modules([path], source="rl.reward")
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and os.path.exists(file) and os.path.samefile(file, path):
            return module
    raise RewardError(f"rl.reward: {path} was imported but its module is not in sys.modules")


def _find_module(name: str, imports: Sequence[str]) -> Any:
    """The module ``name``: a ``.py`` file of ``imports`` with that stem, else a module of that name."""
    for entry in imports:
        if entry.endswith(".py") and os.path.splitext(os.path.basename(entry))[0] == name:
            if not os.path.isfile(entry):
                raise RewardError(f"rl.reward: the file {entry!r} named in experiment.imports does not exist")
            return _module_of_file(os.path.abspath(entry))
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:  # the module exists but imports something absent
            raise
        listed = ", ".join(imports) or "nothing"
        raise RewardError(
            f"rl.reward {name}:...: no module {name!r}: not importable, and experiment.imports ({listed}) "
            f"names no {name}.py"
        ) from None


def build_reward(spec: str, imports: Sequence[str] = ()) -> RewardFn:
    """The reward function ``spec`` names (see the module's list); ``imports``: ``experiment.imports``."""
    if not isinstance(spec, str) or not spec:
        raise RewardError(
            f"rl.reward: expected a reward name ({', '.join(BUILT_INS)} or module:function), got {spec!r}"
        )
    if spec == "exact_match":
        return exact_match
    if spec == "math":
        return _math_reward()
    if spec.startswith("regex:"):
        return _regex_reward(spec[len("regex:") :])
    module_name, sep, function = spec.partition(":")
    if not sep or not module_name or not function:
        raise RewardError(f"rl.reward {spec!r}: not a built-in reward ({', '.join(BUILT_INS)}) nor module:function")
    module = _find_module(module_name, imports)
    fn = getattr(module, function, None)
    if fn is None:
        raise RewardError(
            f"rl.reward {spec!r}: module {module_name} ({getattr(module, '__file__', module.__name__)}) "
            f"has no function {function!r}"
        )
    if not callable(fn):
        raise RewardError(f"rl.reward {spec!r}: {module_name}.{function} is a {type(fn).__name__}, not a function")
    return fn


def score(reward_fn: RewardFn, prompt: str, response: str, record: dict, where: str) -> float:
    """``reward_fn(prompt, response, record)`` as a float; ``where`` (the record's ``file:line``) is named
    in the :class:`RewardError` raised when it fails, reads a missing field or returns no finite number."""
    name = getattr(reward_fn, "__name__", repr(reward_fn))
    try:
        value = reward_fn(prompt, response, record)
    except KeyError as err:
        field = err.args[0] if err.args else "?"
        raise RewardError(
            f"{where}: reward {name} reads the field {field!r}, which this record lacks (it has: "
            f"{', '.join(sorted(map(str, record))) or 'no fields'})"
        ) from err
    except Exception as err:
        raise RewardError(f"{where}: reward {name} raised {type(err).__name__}: {err}") from err
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) and not (hasattr(value, "item") and getattr(value, "ndim", 1) == 0):
        raise RewardError(f"{where}: reward {name} returned {type(value).__name__} {value!r}, expected a float")
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"{where}: reward {name} returned {value}, expected a finite float")
    return value
