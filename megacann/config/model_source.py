"""``model.init_from``: the architecture of the weights a fine-tuning run starts from fills the recipe's.

The weights are loaded later, by the trainer (:mod:`megacann.training.finetune`); here only the model
settings are read, so a recipe may leave the sizes out and take them from what it starts from. Where the
settings live in each kind of directory:

- a megacann checkpoint (``checkpoint_<step>/``) or output directory: the resolved recipe ``config.yaml``
  (an output directory without one: the checkpoint its ``latest`` file names);
- a consolidated directory (``megacann-convert consolidate``): ``model_config.json``;
- a Hugging Face directory: ``config.json``, read by its family's adapter (LLaMA, Mixtral).

Only the architecture keys (:func:`megacann.config.families.architecture_keys`) are taken. A key the recipe leaves unset or at its
default takes the source's value; a key the recipe sets to another value is an error (those weights
cannot be loaded into that shape); precision, dropout, recomputation and the like stay the recipe's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import yaml

from megacann.config.families import architecture_keys
from megacann.config.schema import ConfigError, MegacannConfig

RECIPE_FILE = "config.yaml"  # a checkpoint's (and a run's output directory's) resolved recipe
CONSOLIDATED_CONFIG = "model_config.json"
HF_CONFIG = "config.json"
LATEST_POINTER = "latest"


def _read_json(file: str) -> dict[str, Any]:
    try:
        with open(file) as f:
            values = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{file}: unreadable: {err}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{file}: expected a JSON object of model settings")
    return values


def source_model_settings(path: str) -> tuple[dict[str, Any], str]:
    """The model settings (ModelConfig field names) of the weights in directory ``path``, and the file they
    came from. Raises ConfigError when ``path`` holds no model that megacann can start from."""
    if not os.path.isdir(path):
        raise ConfigError(f"model.init_from: {path!r} is not a directory")
    recipe = os.path.join(path, RECIPE_FILE)
    if os.path.isfile(recipe):
        try:
            with open(recipe) as f:
                raw = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"{recipe}: unreadable: {err}") from None
        model = raw.get("model") if isinstance(raw, dict) else None
        if not isinstance(model, dict):
            raise ConfigError(f"{recipe}: no model section")
        return model, recipe
    consolidated = os.path.join(path, CONSOLIDATED_CONFIG)
    if os.path.isfile(consolidated):
        return _read_json(consolidated), consolidated
    hf = os.path.join(path, HF_CONFIG)
    if os.path.isfile(hf):
        from megacann.models.hf import hf_family  # the family's adapter reads its names (e.g. Mixtral's experts)

        _, model_cfg = hf_family(path)
        return dataclasses.asdict(model_cfg), hf
    pointer = os.path.join(path, LATEST_POINTER)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        if name and os.path.isdir(os.path.join(path, name)):
            return source_model_settings(os.path.join(path, name))
    raise ConfigError(
        f"model.init_from: {path!r} is neither a megacann checkpoint or output directory ({RECIPE_FILE}), a "
        f"consolidated directory ({CONSOLIDATED_CONFIG}) nor a Hugging Face directory ({HF_CONFIG})"
    )


def apply_model_source(cfg: MegacannConfig, source: str = "<recipe>") -> None:
    """Fill ``cfg.model``'s architecture from ``model.init_from`` (nothing when unset); idempotent."""
    m = cfg.model
    if not m.init_from:
        return
    settings, file = source_model_settings(m.init_from)
    defaults = type(m)()
    conflicts = []
    for key in architecture_keys(m):
        if key not in settings:
            continue
        value, mine = settings[key], getattr(m, key)
        if mine == value:
            continue
        if mine is None or mine == getattr(defaults, key):
            setattr(m, key, value)
        else:
            conflicts.append(f"model.{key} is {mine!r} in the recipe but {value!r} there")
    if conflicts:
        raise ConfigError(
            f"{source}: model.init_from {m.init_from!r} ({file}): {'; '.join(conflicts)}. The weights fix the "
            "architecture: drop these keys from the recipe or make them agree"
        )
