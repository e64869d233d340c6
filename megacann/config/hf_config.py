"""Hugging Face style config.json: read, its family recognised by ``model_type``, its keys mapped onto the
fields of a family's configuration class (``HF_KEYS``; ``HF_INERT_KEYS`` only at their inert value;
``HF_VALUE_KEYS`` translated value by value)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any, Optional

from megacann.config.advice import advise
from megacann.config.families import family_of_hf_model_type, model_config_class
from megacann.config.schema import ConfigError, ModelConfig

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
    "quantization_config",  # how the weights are stored: read (or refused) where they are, megacann.interop
}
# config.json files parsed by this process, by (real path, inode, size, mtime): a start-up reads each once
_PARSED: dict[tuple[str, int, int, int], dict[str, Any]] = {}


def read_hf_config(path: str) -> dict[str, Any]:
    """A Hugging Face style config.json as a dict (rope settings of transformers >= 5 moved back to the
    top level, where older files keep them). The file is parsed once per process while it stays unchanged
    (every reader of a start-up asks); each caller gets its own copy."""
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _PARSED:
        _PARSED[key] = _parse_hf_config(path)
    return copy.deepcopy(_PARSED[key])


def _parse_hf_config(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object of model settings")
    rope = raw.get("rope_parameters")  # transformers >= 5 keeps rope_theta and the scaling here
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        return raw  # one set per rotary kind (DeepSeek-V4's main / compress): the family reads them
    if isinstance(rope, dict):
        raw = {k: v for k, v in raw.items() if k != "rope_parameters"}
        rope = dict(rope)
        for key in ("rope_theta", "partial_rotary_factor"):  # top-level keys in older files
            if key in rope:
                raw.setdefault(key, rope.pop(key))
        if rope.get("rope_type", "default") != "default":
            raw.setdefault("rope_scaling", rope)
    return raw


def hf_config_family(raw: dict[str, Any]) -> Optional[str]:
    """The registered family a config.json describes (by its ``model_type``), if megacann knows one."""
    family = family_of_hf_model_type(raw.get("model_type"))
    if family is None and (raw.get("model_type") == "gpt2" or "n_embd" in raw):
        family = "gpt"
    return family


def load_hf_model_config(
    path: str, model_cls: Optional[type[ModelConfig]] = None, raw: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """Map a Hugging Face style config.json onto the field names of a family's configuration
    (``model_cls``; None: the family its ``model_type`` names, else the shared keys alone). The family is
    returned as ``type`` when config.json names one. ``raw``: the file as :func:`read_hf_config` parsed
    it (None: read here); errors name ``path``."""
    raw = read_hf_config(path) if raw is None else raw
    family = hf_config_family(raw)
    if model_cls is None:
        model_cls = model_config_class(family, path) if family else ModelConfig
    names = {f.name for f in dataclasses.fields(model_cls)}
    mapped: dict[str, Any] = {"type": family} if family else {}
    for key, value in raw.items():
        if key in model_cls.HF_INERT_KEYS:
            if value != model_cls.HF_INERT_KEYS[key]:
                raise ConfigError(f"{path}: {key} {value!r} is not supported (only {model_cls.HF_INERT_KEYS[key]!r})")
        elif key in model_cls.HF_KEYS:
            mapped[model_cls.HF_KEYS[key]] = value
        elif key in model_cls.HF_VALUE_KEYS:
            name, values = model_cls.HF_VALUE_KEYS[key]
            mapped[name] = _translated(key, value, values, path)
        elif key in names and key != "type":
            mapped[key] = value
        elif key not in HF_IGNORED_KEYS:
            advise(f"{path}: model key '{key}' is not used by megacann and is ignored")
    _check_implied_head_dim(raw, names, path)
    act = raw.get("hidden_act")
    if act is not None and act not in ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"{path}: hidden_act {act!r} is not supported (expected silu or gelu)")
    return mapped


def _translated(key: str, value: Any, values: dict, path: str) -> Any:
    """The field value config.json's ``value`` of ``key`` stands for (of the same type: ``1`` is not ``true``)."""
    for known, meant in values.items():
        if type(known) is type(value) and known == value:
            return meant
    expected = ", ".join(json.dumps(known) for known in values)
    raise ConfigError(f"{path}: {key} {json.dumps(value)} is not supported (expected one of: {expected})")


def _check_implied_head_dim(raw: dict[str, Any], names: set[str], path: str) -> None:
    """A family without a ``head_dim`` key has heads of hidden_size / num_attention_heads: a config.json
    naming other heads would load into the wrong shapes, so it is refused (not ignored)."""
    head_dim, hidden, heads = raw.get("head_dim"), raw.get("hidden_size"), raw.get("num_attention_heads")
    if "head_dim" in names or head_dim is None or not hidden or not heads:
        return
    if head_dim * heads != hidden:
        raise ConfigError(
            f"{path}: head_dim {head_dim} is not hidden_size {hidden} / num_attention_heads {heads}, and this "
            "model family has heads of that width only (a family with a head_dim key, e.g. mistral or qwen3, "
            "reads it)"
        )
