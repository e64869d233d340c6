"""Reading recipes: YAML and Hugging Face config.json, type checking, dotted overrides, "did you mean"."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import typing
from typing import Any, Optional, Union

import yaml

from megacann.config.families import (
    DEFAULT_FAMILY,
    families_with_key,
    import_family_modules,
    model_config_class,
    resolve_imports,
    switch_family,
)
from megacann.config.hf_config import load_hf_model_config
from megacann.config.schema import (
    _SECTION_CLASSES,
    TOP_LEVEL_KEYS,
    ConfigError,
    MegacannConfig,
    ModelConfig,
)
from megacann.config.validation import validate

# Names users reach for from other frameworks, mapped to ours (used for "did you mean").
SYNONYMS = {
    "learning_rate": "optim.lr",
    "lr_scheduler": "optim.scheduler",
    "lr_decay_style": "optim.scheduler",
    "min_lr": "optim.min_lr_ratio",
    "lr_warmup_fraction": "optim.warmup_ratio",
    "lr_warmup_iters": "optim.warmup_steps",
    "train_iters": "optim.max_steps",
    "gradient_accumulation_steps": "optim.grad_accum_steps",
    "max_grad_norm": "optim.clip_grad",
    "micro_batch_size": "data.batch_size",
    "seq_len": "data.seq_length",
    "max_seq_len": "data.seq_length",
    "tp": "distributed.tensor_parallel_size",
    "pp": "distributed.pipeline_parallel_size",
    "dp": "distributed.data_parallel_size",
    "tensor_model_parallel_size": "distributed.tensor_parallel_size",
    "pipeline_model_parallel_size": "distributed.pipeline_parallel_size",
    "zero_stage": "distributed.zero_optimization",
    "use_distributed_optimizer": "distributed.zero_optimization",
    "save_interval": "logging.ckpt_interval",
    "n_layer": "model.num_layers",
    "n_head": "model.num_attention_heads",
}


def model_aliases(model_cls: type[ModelConfig]) -> dict[str, str]:
    """Hugging Face names a family's recipe accepts inline for its fields (``num_hidden_layers`` ...)."""
    return {k: v for k, v in model_cls.HF_KEYS.items() if k != v}


def all_dotted_keys(model_cls: type[ModelConfig] = ModelConfig) -> list[str]:
    """Every recipe key, the model section's being those of the family configuration ``model_cls``."""
    keys = list(TOP_LEVEL_KEYS)
    for section, cls in _SECTION_CLASSES.items():
        cls = model_cls if section == "model" else cls
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def suggest_key(dotted: str, model_cls: type[ModelConfig] = ModelConfig) -> Optional[str]:
    """The closest valid dotted key for a misspelt or foreign one (the model section's keys: those of the
    family configuration ``model_cls``). Near-misses of a synonym lead to the key it stands for
    (``optim.learnig_rate`` -> ``optim.lr``), so the synonyms compete with the section's keys."""
    leaf = dotted.split(".")[-1]
    if leaf in SYNONYMS:
        return SYNONYMS[leaf]
    keys = all_dotted_keys(model_cls)
    section = dotted.split(".")[0] if "." in dotted else None
    if section:
        candidates = {k.split(".")[-1]: k for k in keys if k.startswith(section + ".")}
    else:  # a top-level name: a section or a top-level key
        candidates = {k: k for k in [*_SECTION_CLASSES, *TOP_LEVEL_KEYS]}
    for synonym, key in SYNONYMS.items():
        candidates.setdefault(synonym, key)
    match = difflib.get_close_matches(leaf, list(candidates), n=1, cutoff=0.6)
    if match:
        return candidates[match[0]]
    match = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.6)
    if match:
        return match[0]
    by_leaf = {k.split(".")[-1]: k for k in keys}
    match = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
    return by_leaf[match[0]] if match else None


def _unknown_key(dotted: str, source: str, model: Optional[ModelConfig] = None) -> ConfigError:
    if not isinstance(dotted, str):  # YAML reads `0:` or `true:` as a number or a boolean key
        return ConfigError(f"{source}: key {dotted!r} is not a name: recipe keys are words like optim.lr")
    model_cls = type(model) if model is not None else ModelConfig
    if dotted.startswith("model.") and model is not None:
        owners = families_with_key(dotted.split(".", 1)[1])
        if owners:  # a real key, of another family
            return ConfigError(
                f"{source}: unknown key '{dotted}' for model.type {model.type!r}: it is a key of model "
                f"family {' / '.join(repr(o) for o in owners)} (set model.type to use it)"
            )
    hint = suggest_key(dotted, model_cls)
    extra = f"; did you mean '{hint}'?" if hint else ""
    return ConfigError(f"{source}: unknown key '{dotted}'{extra}")


# -- type checking ---------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None)) + " (or null)" * (
            type(None) in typing.get_args(tp)
        )
    if origin is not None:
        return origin.__name__
    return getattr(tp, "__name__", str(tp))


class _NotFinite(ConfigError):
    """A number that is not finite: the message stands whatever other types the key allows."""


def _coerce(value: Any, tp: Any, where: str, source: str) -> Any:
    """Check ``value`` against the field type ``tp``; numbers written as strings are converted."""
    origin = typing.get_origin(tp)
    if origin is Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where, source)
            except _NotFinite:
                raise
            except ConfigError:
                continue
        raise ConfigError(f"{source}: {where}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    target = origin or tp
    ok = False
    if target is bool:
        ok = isinstance(value, bool)
    elif target is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif target is float:
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
        if ok and not math.isfinite(value):
            raise _NotFinite(f"{source}: {where}: expected a finite number, got {value!r}")
    elif target is str:
        ok = isinstance(value, str)
    elif target in (list, dict):
        ok = isinstance(value, target)
    else:
        ok = isinstance(value, target)
    if not ok:
        raise ConfigError(f"{source}: {where}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return value


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _set_field(obj: Any, name: str, value: Any, where: str, source: str) -> None:
    types = _field_types(type(obj))
    setattr(obj, name, _coerce(value, types[name], where, source))


# -- loading ---------------------------------------------------------------------------------------


def _resolve_path(path: str, base_dir: Optional[str], key: str, source: str) -> str:
    candidates = [path] if os.path.isabs(path) else [os.path.join(base_dir or "", path), path]
    for candidate in candidates:
        if os.path.exists(candidate):
            return os.path.abspath(candidate)
    tried = " or ".join(repr(os.path.abspath(c)) for c in dict.fromkeys(candidates))
    raise ConfigError(f"{source}: {key}: file not found: {path!r} (looked for {tried})")


def _apply_section(obj: Any, section: str, values: Any, source: str) -> None:
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: section '{section}' must be a mapping of keys to values, got {values!r}")
    names = {f.name for f in dataclasses.fields(obj)}
    aliases = model_aliases(type(obj)) if section == "model" else {}
    for key, value in values.items():
        name = aliases.get(key, key)
        if name not in names:
            raise _unknown_key(f"{section}.{key}" if isinstance(key, str) else key, source, _model_of(obj, section))
        _set_field(obj, name, value, f"{section}.{key}", source)


def _model_of(obj: Any, section: str) -> Optional[ModelConfig]:
    return obj if section == "model" else None


def _family_imports(raw: dict, source: str, base_dir: Optional[str]) -> list[str]:
    """``experiment.imports`` of a parsed recipe, resolved and imported (their families register)."""
    experiment = raw.get("experiment")
    if not isinstance(experiment, dict) or "imports" not in experiment:
        return []
    imports = resolve_imports(experiment["imports"], base_dir, source)
    import_family_modules(imports, source)
    return imports


def config_from_dict(raw: dict, source: str = "<recipe>", base_dir: Optional[str] = None) -> MegacannConfig:
    """Build a config from a parsed recipe; ``source`` names the file in error messages. The model section
    is read into its family's configuration class (``model.type``, else the family config.json's
    ``model_type`` names, else LLaMA), after importing the modules of ``experiment.imports``."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a recipe must be a mapping of sections, got {type(raw).__name__}")
    imports = _family_imports(raw, source, base_dir)
    cfg = MegacannConfig()
    model_raw = raw.get("model") or {}
    hf_values: dict[str, Any] = {}
    json_path = None
    if isinstance(model_raw, dict) and model_raw.get("config_path") is not None:
        if not isinstance(model_raw["config_path"], str):
            value = model_raw["config_path"]
            raise ConfigError(f"{source}: model.config_path: expected str, got {value!r} ({type(value).__name__})")
        json_path = _resolve_path(model_raw["config_path"], base_dir, "model.config_path", source)
        model_raw = {**model_raw, "config_path": json_path}
        hf_values = load_hf_model_config(json_path, None)
    family = model_raw.get("type") if isinstance(model_raw, dict) else None
    if family is not None and not isinstance(family, str):
        raise ConfigError(f"{source}: model.type: expected str, got {family!r} ({type(family).__name__})")
    family = family or hf_values.get("type") or DEFAULT_FAMILY
    cfg.model = model_config_class(family, source)()
    if json_path is not None:
        hf_values = load_hf_model_config(json_path, type(cfg.model))
        hf_values.pop("type", None)
        _apply_section(cfg.model, "model", hf_values, json_path)
    for key, value in raw.items():
        if key in _SECTION_CLASSES:
            _apply_section(getattr(cfg, key), key, value if key != "model" else model_raw, source)
        elif key in TOP_LEVEL_KEYS:
            _set_field(cfg, key, value, key, source)
        else:
            raise _unknown_key(key, source)
    cfg.model.type = family
    cfg.experiment.imports = imports
    return cfg


def _parse_override_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(cfg: MegacannConfig, overrides: list[str], source: str = "command line") -> MegacannConfig:
    """Apply ``section.key=value`` (or top-level ``key=value``) overrides, with type checking."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{source}: override {item!r} must look like section.key=value")
        dotted, text = item.split("=", 1)
        dotted = dotted.strip().lstrip("-")
        value = _parse_override_value(text)
        where = f"{source} override {item!r}"
        if "." in dotted:
            section, key = dotted.split(".", 1)
            if section not in _SECTION_CLASSES:
                raise _unknown_key(dotted, where)
            if dotted == "experiment.imports":
                value = resolve_imports(value, None, where)
                import_family_modules(value, where)
            if dotted == "model.type" and isinstance(value, str):
                cfg.model = switch_family(cfg.model, value, where)
            obj = getattr(cfg, section)
            name = model_aliases(type(obj)).get(key, key) if section == "model" else key
            if name not in {f.name for f in dataclasses.fields(obj)}:
                raise _unknown_key(dotted, where, _model_of(obj, section))
            _set_field(obj, name, value, dotted, where)
        elif dotted in TOP_LEVEL_KEYS:
            _set_field(cfg, dotted, value, dotted, where)
        else:
            raise _unknown_key(dotted, where)
    return cfg


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error as one line, with the line (and column) numbers where it was found, 1-based."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context, context_mark = getattr(err, "context", None), getattr(err, "context_mark", None)
    started = f" ({context} started at line {context_mark.line + 1})" if context and context_mark is not None else ""
    return f"{where}{problem}{started}"


def _override_key(item: str) -> str:
    return item.split("=", 1)[0].strip().lstrip("-")


def _imports_first(overrides: list[str]) -> list[str]:
    """Overrides with ``experiment.imports=`` first and ``model.type=`` next: the families they name are
    known, and the model section has its family's keys, before the other overrides are read."""
    rank = {"experiment.imports": 0, "model.type": 1}
    return sorted(overrides, key=lambda item: rank.get(_override_key(item), 2))


def _import_override_families(overrides: list[str]) -> None:
    """Import the modules of an ``experiment.imports=`` override before the recipe's model section is read
    (the recipe's ``model.type`` may be the family they register)."""
    for item in overrides:
        if "=" in item and _override_key(item) == "experiment.imports":
            where = f"command line override {item!r}"
            import_family_modules(resolve_imports(_parse_override_value(item.split("=", 1)[1]), None, where), where)


def load_config(path: str, overrides: Optional[list[str]] = None, world_size: Optional[int] = None) -> MegacannConfig:
    """Load, override and validate a recipe. ``world_size`` is the runtime world (torchrun), if known."""
    if not os.path.exists(path):
        raise ConfigError(f"recipe not found: {path!r}")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(err)}") from None
    _import_override_families(overrides or [])
    cfg = config_from_dict(raw, source=path, base_dir=os.path.dirname(os.path.abspath(path)))
    apply_overrides(cfg, _imports_first(overrides or []))
    validate(cfg, world_size=world_size, source=path)
    return cfg
