"""The recipe's ``generation_eval`` section: a small generation evaluation every ``interval`` steps during
training (run by :mod:`megacann.training.generation_eval`), its checks, and the scorer it names.

A scorer is ``exact_match`` (the completion, stripped, equals the line's ``answer``, stripped),
``regex:<pattern>`` (the pattern's first match in the completion — its first group when it has one —
equals the answer, both stripped) or ``module:function``, a function of a module named in
``experiment.imports`` (a module name, or a ``.py`` file whose stem is ``module``) called as
``function(completion, record)`` with the line's whole JSON object, returning a number.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

BUILT_IN_SCORERS = ("exact_match", "regex:<pattern>", "module:function")
Scorer = Callable[[str, dict], float]


@dataclass
class GenerationEvalConfig:
    """``generation_eval``: generate from the JSONL ``prompts`` (``{"prompt": TEXT, "answer": TEXT}`` a
    line) every ``interval`` steps and at the last, at the training layout; log the mean score and the
    mean response length (tokens) as ``generation_score`` / ``generation_length``."""

    interval: int = 0  # 0: off
    prompts: Optional[str] = None  # the JSONL file (relative paths: from the working directory)
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy; else sampled with seed + the line's number
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    seed: int = 0
    batch_size: int = 8  # prompts per generate call on each data-parallel rank
    scorer: str = "exact_match"  # exact_match | regex:<pattern> | module:function (see the module docstring)


def generation_cache_slots(cfg: Any) -> int:
    """Cache slots a row of the recipe ``cfg``'s generation_eval: the longest prompt allowed
    (``data.seq_length`` tokens) plus the new tokens but the last (never fed back)."""
    return cfg.data.seq_length + cfg.generation_eval.max_new_tokens - 1


def find_scorer(spec: str, imports: list[str], where: str = "generation_eval.scorer") -> Scorer:
    """The scoring function ``spec`` names; a ValueError naming ``where`` when there is none."""
    if spec == "exact_match":
        return lambda completion, record: float(completion.strip() == _answer(record))
    if spec.startswith("regex:"):
        try:
            pattern = re.compile(spec[len("regex:") :])
        except re.error as err:
            raise ValueError(f"{where} {spec!r}: not a regular expression ({err})") from None
        return lambda completion, record: float(_first_match(pattern, completion) == _answer(record))
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"{where} {spec!r}: expected one of {', '.join(BUILT_IN_SCORERS)}")
    module = _imported_module(module_name, imports)
    if module is None:
        raise ValueError(
            f"{where} {spec!r}: module {module_name!r} is not in experiment.imports "
            f"({', '.join(imports) or 'empty'}); list it there so every rank imports it"
        )
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"{where} {spec!r}: module {module_name!r} has no function {function_name!r}")
    return function


def _answer(record: dict) -> str:
    return str(record.get("answer", "")).strip()


def _first_match(pattern: re.Pattern, text: str) -> Optional[str]:
    found = pattern.search(text)
    if found is None:
        return None
    return (found.group(1) if pattern.groups else found.group(0)).strip()


def _imported_module(name: str, imports: list[str]) -> Any:
    """The module of ``experiment.imports`` called ``name`` (a module name, or a .py file's stem)."""
    for entry in imports:
        if entry == name:
            return importlib.import_module(entry)
        if entry.endswith(".py") and os.path.splitext(os.path.basename(entry))[0] == name:
            for module in list(sys.modules.values()):
                file = getattr(module, "__file__", None)
                if isinstance(file, str) and os.path.exists(file) and os.path.samefile(file, entry):
                    return module
    return None


def check_generation_eval(section: GenerationEvalConfig, imports: list[str], pipeline_stages: int, source: str) -> None:
    """Each key of an enabled section holds a usable value (ConfigError naming the key otherwise)."""
    from megacann.config.schema import ConfigError

    if section.interval < 0:
        raise ConfigError(f"{source}: generation_eval.interval must be >= 0 (0: off), got {section.interval}")
    if section.interval == 0:
        return
    if not section.prompts:
        raise ConfigError(f"{source}: generation_eval.prompts: a JSONL file of prompts is needed when interval > 0")
    if not os.path.isfile(section.prompts):
        raise ConfigError(f"{source}: generation_eval.prompts: file not found: {section.prompts!r}")
    for key, (bad, expected) in {
        "max_new_tokens": (section.max_new_tokens < 1, ">= 1"),
        "batch_size": (section.batch_size < 1, ">= 1"),
        "temperature": (section.temperature < 0, ">= 0 (0: greedy)"),
        "top_k": (section.top_k < 0, ">= 0 (0: off)"),
        "top_p": (not 0 < section.top_p <= 1, "in (0, 1] (1: off)"),
        "min_p": (not 0 <= section.min_p <= 1, "in [0, 1] (0: off)"),
    }.items():
        if bad:
            raise ConfigError(f"{source}: generation_eval.{key} must be {expected}, got {getattr(section, key)!r}")
    if pipeline_stages > 1:
        raise ConfigError(
            f"{source}: generation_eval needs the whole model on each rank: generation under pipeline "
            f"parallelism ({pipeline_stages} stages) is not supported yet"
        )
    try:
        find_scorer(section.scorer, imports)
    except ValueError as err:
        raise ConfigError(f"{source}: {err}") from None
