"""Training recipes: dataclasses for every section, YAML loading, dotted overrides and validation.

A recipe is a YAML file with the sections of :class:`MegacannConfig` (``schema``). Unknown keys, wrong
types and inconsistent parallel sizes are errors that name the file, the key, the value and what was
expected, with the closest valid key for a typo (``loading``, ``validation``). A model may be given inline
or through ``model.config_path``, a Hugging Face style ``config.json`` mapped onto :class:`ModelConfig`.
The model section is read into the configuration class of its family (``families``): the keys every
decoder has live here, a family's own keys in the family's files.
"""

from megacann.config.families import (
    architecture_keys,
    model_config_class,
    model_config_from_dict,
    register_model_config,
    shape_keys,
)
from megacann.config.hf_config import load_hf_model_config
from megacann.config.loading import (
    SYNONYMS,
    all_dotted_keys,
    apply_overrides,
    config_from_dict,
    load_config,
    suggest_key,
)
from megacann.config.schema import (
    CHOICES,
    TOP_LEVEL_KEYS,
    ConfigError,
    DataConfig,
    DistributedConfig,
    ExperimentConfig,
    LoggingConfig,
    MegacannConfig,
    ModelConfig,
    OptimConfig,
    PrecisionConfig,
    TrainingConfig,
)
from megacann.config.validation import resolve_parallel_sizes, validate

__all__ = [
    "CHOICES",
    "SYNONYMS",
    "TOP_LEVEL_KEYS",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "ExperimentConfig",
    "LoggingConfig",
    "MegacannConfig",
    "ModelConfig",
    "OptimConfig",
    "PrecisionConfig",
    "TrainingConfig",
    "all_dotted_keys",
    "architecture_keys",
    "model_config_class",
    "model_config_from_dict",
    "register_model_config",
    "shape_keys",
    "apply_overrides",
    "config_from_dict",
    "load_config",
    "load_hf_model_config",
    "resolve_parallel_sizes",
    "suggest_key",
    "validate",
]
