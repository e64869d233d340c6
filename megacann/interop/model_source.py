"""``model.init_from``: the architecture of the weights a fine-tuning run starts from fills the recipe's.

The weights are loaded later, by the trainer (:mod:`megacann.training.finetune`); here only the model
settings are read, so a recipe may leave the sizes out and take them from what it starts from. The
directory's kind is :func:`~megacann.interop.sources.resolve_weight_source`'s answer, and its settings
come from

- a megacann checkpoint (or an output directory: its latest complete checkpoint): ``megacann.json``;
- a consolidated directory (``megacann-convert consolidate``): ``model_config.json``;
- a Hugging Face directory: ``config.json``, read by its family's adapter (LLaMA, Mixtral).

Only the architecture keys (:func:`megacann.config.families.architecture_keys`) are taken. A key the recipe
leaves unset or at its default takes the source's value; a key the recipe sets to another value is an
error (those weights cannot be loaded into that shape); precision, dropout, recomputation and the like
stay the recipe's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from megacann.checkpoint.metadata import CheckpointError, read_info
from megacann.config import ConfigError, MegacannConfig
from megacann.config.families import architecture_keys, switch_family
from megacann.interop.hf import hf_family
from megacann.interop.names import CONSOLIDATED_CONFIG, HF_CONFIG, INFO_FILE
from megacann.interop.sources import CHECKPOINT, CONSOLIDATED, resolve_weight_source


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
    try:
        found = resolve_weight_source(path, "model.init_from")
        if found.kind == CHECKPOINT:
            file = os.path.join(found.path, INFO_FILE)
            model = read_info(found.path).get("model")
            if not isinstance(model, dict):
                raise ConfigError(f"{file}: no model settings")
            return model, file
    except CheckpointError as err:
        raise ConfigError(str(err)) from None
    if found.kind == CONSOLIDATED:
        file = os.path.join(found.path, CONSOLIDATED_CONFIG)
        return _read_json(file), file
    _, model_cfg, _ = hf_family(found.path)  # the family's adapter reads its names (e.g. Mixtral's experts)
    return dataclasses.asdict(model_cfg), os.path.join(found.path, HF_CONFIG)


def apply_model_source(cfg: MegacannConfig, source: str = "<recipe>") -> None:
    """Fill ``cfg.model``'s architecture from ``model.init_from`` (nothing when unset); idempotent."""
    m = cfg.model
    if not m.init_from:
        return
    settings, file = source_model_settings(m.init_from)
    family = settings.get("type")
    carried = None  # the defaults of the class the recipe was read into, when the source's family replaces it
    if family and family != m.type and m.type == type(m)().type:  # the source's family, read into its class
        carried = type(m)()
        cfg.model = m = switch_family(m, family, f"{source}: model.init_from {m.init_from!r} ({file})")
    defaults = type(m)()
    conflicts = []
    for key in architecture_keys(m):
        if key not in settings:
            continue
        value, mine = settings[key], getattr(m, key)
        if mine == value:
            continue
        # unset: None, the family's default, or a default of the recipe's class carried over by the switch
        # (e.g. rotary_interleaved false, which deepseek_v3 defaults to true)
        if mine is None or mine == getattr(defaults, key) or mine == getattr(carried, key, object()):
            setattr(m, key, value)
        else:
            conflicts.append(f"model.{key} is {mine!r} in the recipe but {value!r} there")
    if conflicts:
        raise ConfigError(
            f"{source}: model.init_from {m.init_from!r} ({file}): {'; '.join(conflicts)}. The weights fix the "
            "architecture: drop these keys from the recipe or make them agree"
        )
