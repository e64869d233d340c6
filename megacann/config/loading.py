"""Reading recipes: YAML and Hugging Face config.json, type checking, dotted overrides, "did you mean"."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import os
import typing
from typing import Any, Optional, Union

import yaml

from megacann.config.advice import advise
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

# Hugging Face config.json keys mapped onto ModelConfig fields.
HF_MODEL_KEYS = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "intermediate_size": "ffn_hidden_size",
    "vocab_size": "vocab_size",
    "rms_norm_eps": "norm_eps",
    "layer_norm_eps": "norm_eps",
    "layer_norm_epsilon": "norm_eps",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
    "initializer_range": "init_method_std",
    "attention_dropout": "attention_dropout",
    "attention_bias": "add_bias_linear",
    "num_local_experts": "num_experts",  # Mixtral
    "num_experts_per_tok": "moe_top_k",
    "router_aux_loss_coef": "moe_aux_loss_coeff",
}
# Keys of HF configs that carry nothing megacann needs (accepted silently).
HF_IGNORED_KEYS = {
    "architectures",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "pretraining_tp",
    "hidden_act",
    "mlp_bias",
    "head_dim",
    "_name_or_path",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "auto_map",
    "output_router_logits",
}
# Keys of HF configs megacann reads only at the value that changes nothing (others are refused).
HF_INERT_KEYS = {"sliding_window": None, "router_jitter_noise": 0.0}
# Aliases accepted inline in the recipe's model section too (HF names are familiar to users).
MODEL_ALIASES = {k: v for k, v in HF_MODEL_KEYS.items() if k != v}


def all_dotted_keys() -> list[str]:
    keys = list(TOP_LEVEL_KEYS)
    for section, cls in _SECTION_CLASSES.items():
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def suggest_key(dotted: str) -> Optional[str]:
    """The closest valid dotted key for a misspelt or foreign one. Near-misses of a synonym lead to the key
    it stands for (``optim.learnig_rate`` -> ``optim.lr``), so the synonyms compete with the section's keys."""
    leaf = dotted.split(".")[-1]
    if leaf in SYNONYMS:
        return SYNONYMS[leaf]
    keys = all_dotted_keys()
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


def _unknown_key(dotted: str, source: str) -> ConfigError:
    if not isinstance(dotted, str):  # YAML reads `0:` or `true:` as a number or a boolean key
        return ConfigError(f"{source}: key {dotted!r} is not a name: recipe keys are words like optim.lr")
    hint = suggest_key(dotted)
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


def load_hf_model_config(path: str) -> dict[str, Any]:
    """Map a Hugging Face style config.json onto ModelConfig field names."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object of model settings")
    mapped: dict[str, Any] = {}
    rope = raw.get("rope_parameters")  # transformers >= 5 keeps rope_theta and the scaling here
    if isinstance(rope, dict):
        raw = {k: v for k, v in raw.items() if k != "rope_parameters"}
        rope = dict(rope)
        if "rope_theta" in rope:
            raw.setdefault("rope_theta", rope.pop("rope_theta"))
        if rope.get("rope_type", "default") != "default":
            raw.setdefault("rope_scaling", rope)
    for key, value in raw.items():
        if key in HF_INERT_KEYS:
            if value != HF_INERT_KEYS[key]:
                raise ConfigError(f"{path}: {key} {value!r} is not supported (only {HF_INERT_KEYS[key]!r})")
        elif key in HF_MODEL_KEYS:
            mapped[HF_MODEL_KEYS[key]] = value
        elif key in {f.name for f in dataclasses.fields(ModelConfig)}:
            mapped[key] = value
        elif key not in HF_IGNORED_KEYS:
            advise(f"{path}: model key '{key}' is not used by megacann and is ignored")
    act = raw.get("hidden_act")
    if act is not None and act not in ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"{path}: hidden_act {act!r} is not supported (expected silu or gelu)")
    if raw.get("model_type") == "gpt2" or "n_embd" in raw:
        mapped.setdefault("type", "gpt")
    return mapped


def _apply_section(obj: Any, section: str, values: Any, source: str) -> None:
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: section '{section}' must be a mapping of keys to values, got {values!r}")
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in values.items():
        name = MODEL_ALIASES.get(key, key) if section == "model" else key
        if name not in names:
            raise _unknown_key(f"{section}.{key}" if isinstance(key, str) else key, source)
        _set_field(obj, name, value, f"{section}.{key}", source)


def config_from_dict(raw: dict, source: str = "<recipe>", base_dir: Optional[str] = None) -> MegacannConfig:
    """Build a config from a parsed recipe; ``source`` names the file in error messages."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a recipe must be a mapping of sections, got {type(raw).__name__}")
    cfg = MegacannConfig()
    model_raw = raw.get("model") or {}
    if isinstance(model_raw, dict) and model_raw.get("config_path") is not None:
        if not isinstance(model_raw["config_path"], str):
            value = model_raw["config_path"]
            raise ConfigError(f"{source}: model.config_path: expected str, got {value!r} ({type(value).__name__})")
        json_path = _resolve_path(model_raw["config_path"], base_dir, "model.config_path", source)
        _apply_section(cfg.model, "model", load_hf_model_config(json_path), json_path)
        model_raw = {**model_raw, "config_path": json_path}
    for key, value in raw.items():
        if key in _SECTION_CLASSES:
            _apply_section(getattr(cfg, key), key, value if key != "model" else model_raw, source)
        elif key in TOP_LEVEL_KEYS:
            _set_field(cfg, key, value, key, source)
        else:
            raise _unknown_key(key, source)
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
            obj = getattr(cfg, section)
            name = MODEL_ALIASES.get(key, key) if section == "model" else key
            if name not in {f.name for f in dataclasses.fields(obj)}:
                raise _unknown_key(dotted, where)
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


def load_config(path: str, overrides: Optional[list[str]] = None, world_size: Optional[int] = None) -> MegacannConfig:
    """Load, override and validate a recipe. ``world_size`` is the runtime world (torchrun), if known."""
    if not os.path.exists(path):
        raise ConfigError(f"recipe not found: {path!r}")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(err)}") from None
    cfg = config_from_dict(raw, source=path, base_dir=os.path.dirname(os.path.abspath(path)))
    apply_overrides(cfg, overrides or [])
    validate(cfg, world_size=world_size, source=path)
    return cfg
