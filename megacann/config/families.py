"""What the recipe loader knows of model families: each family's configuration class, found by name.

A family (``megacann.models.register_model``) declares its own architecture keys as a dataclass derived
from :class:`~megacann.config.ModelConfig`; the loader reads ``model.*`` into that class, so a key only one
family reads lives in that family's files. This module is the registry the loader consults; it knows no
family itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megacann.config.schema import ConfigError, ModelConfig

# Model settings that decide tensor shapes, shared by every decoder (a family adds its own, see shape_keys).
SHARED_SHAPE_KEYS = (
    "type",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "ffn_hidden_size",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "tie_word_embeddings",
    "add_bias_linear",
    "max_position_embeddings",
)
# Settings that fix how the weights compute without changing their shapes.
SHARED_COMPUTE_KEYS = ("norm_eps", "rope_theta", "rope_scaling", "rotary_interleaved")


def _keys_marked(model_cls: type, mark: str) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(model_cls) if f.metadata.get(mark))


def shape_keys(model: Any) -> tuple[str, ...]:
    """The keys whose values decide tensor shapes of this family's model (``model``: config or class)."""
    cls = model if isinstance(model, type) else type(model)
    return SHARED_SHAPE_KEYS + _keys_marked(cls, "shape")


def architecture_keys(model: Any) -> tuple[str, ...]:
    """What weights a run starts from fix: their shapes (but not the vocabulary padding, chosen on loading)
    and how they compute (positions, norms, a family's own marks, e.g. how tokens choose experts)."""
    cls = model if isinstance(model, type) else type(model)
    shapes = tuple(k for k in shape_keys(cls) if k != "make_vocab_size_divisible_by")
    return shapes + SHARED_COMPUTE_KEYS + _keys_marked(cls, "architecture")


def model_config_from_dict(values: dict[str, Any], source: str = "<model settings>") -> ModelConfig:
    """A family's model configuration from stored settings (a checkpoint's, a consolidated directory's);
    keys the family does not know are left out."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: expected a mapping of model settings, got {type(values).__name__}")
    cls = ModelConfig
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in known})
