"""What the recipe loader knows of model families: each family's configuration class, found by name.

A family (``megacann.models.register_model``) declares its own architecture keys as a dataclass derived
from :class:`~megacann.config.ModelConfig`; the loader reads ``model.*`` into that class, so a key only one
family reads lives in that family's files. This module is the registry the loader consults; it knows no
family itself. Families become known by importing the module that registers them: megacann's own
(:data:`BUILTIN_FAMILY_MODULES`, imported by name when a family is looked up, so that this package does
not depend on them), the modules a recipe names in ``experiment.imports`` (module names or ``.py``
files), and those installed packages announce under the entry-point group :data:`ENTRY_POINT_GROUP`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from importlib import metadata
from typing import Any, Optional

from megacann.config.schema import ConfigError, ModelConfig

BUILTIN_FAMILY_MODULES = ("megacann.models",)
ENTRY_POINT_GROUP = "megacann.model_families"
DEFAULT_FAMILY = "llama"

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

_CONFIG_CLASSES: dict[str, type[ModelConfig]] = {}
_HF_MODEL_TYPES: dict[str, str] = {}  # Hugging Face config.json model_type -> family name: the one such map
_ENTRY_POINTS_LOADED = [False]


def register_model_config(family: str, config_class: type[ModelConfig], hf_model_types: Iterable[str] = ()) -> None:
    """Make ``model.type: <family>`` read its keys into ``config_class`` (megacann.models.register_model
    calls this); ``hf_model_types``: config.json ``model_type`` values that mean this family (a value
    another family already reads is refused: one ``model_type``, one family)."""
    if not (isinstance(config_class, type) and issubclass(config_class, ModelConfig)):
        raise TypeError(f"family {family!r}: config class must derive from ModelConfig, got {config_class!r}")
    for model_type in hf_model_types:
        other = _HF_MODEL_TYPES.get(model_type, family)
        if other != family:
            raise ValueError(
                f"model family {family!r}: Hugging Face model_type {model_type!r} is already read by family "
                f"{other!r} (one model_type, one family)"
            )
    _CONFIG_CLASSES[family] = config_class
    for model_type in [t for t, f in _HF_MODEL_TYPES.items() if f == family]:  # a family registered anew
        del _HF_MODEL_TYPES[model_type]
    for model_type in hf_model_types:
        _HF_MODEL_TYPES[model_type] = family


def known_families() -> list[str]:
    return sorted(_CONFIG_CLASSES)


def _load_entry_points() -> None:
    """Import megacann's family modules and those installed packages announce (once per process)."""
    if _ENTRY_POINTS_LOADED[0]:
        return
    _ENTRY_POINTS_LOADED[0] = True
    for name in BUILTIN_FAMILY_MODULES:
        importlib.import_module(name)
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception as err:
            raise ConfigError(
                f"model families: entry point {entry.name!r} ({entry.value}) of group {ENTRY_POINT_GROUP} "
                f"failed to import: {type(err).__name__}: {err}"
            ) from err


def _is_path(entry: str) -> bool:
    return entry.endswith(".py") or os.sep in entry or "/" in entry


def resolve_imports(imports: Any, base_dir: Optional[str], source: str) -> list[str]:
    """``experiment.imports`` checked and made absolute: module names stay, ``.py`` files become absolute
    paths (looked for beside the recipe, then from the working directory)."""
    if not isinstance(imports, list) or not all(isinstance(i, str) and i for i in imports):
        raise ConfigError(
            f"{source}: experiment.imports: expected a list of module names or .py files, got {imports!r}"
        )
    resolved = []
    for entry in imports:
        if not _is_path(entry):
            resolved.append(entry)
            continue
        candidates = [entry] if os.path.isabs(entry) else [os.path.join(base_dir or "", entry), entry]
        found = next((c for c in candidates if os.path.isfile(c)), None)
        if found is None:
            tried = " or ".join(repr(os.path.abspath(c)) for c in dict.fromkeys(candidates))
            raise ConfigError(f"{source}: experiment.imports: file not found: {entry!r} (looked for {tried})")
        resolved.append(os.path.abspath(found))
    return resolved


def _already_imported(path: str) -> bool:
    """Whether a module of this process was loaded from ``path`` (a script running as ``__main__``, or a
    file a test or script imported under a name of its own): its families are registered already."""
    base = os.path.basename(path)
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        named = isinstance(file, str) and os.path.basename(file) == base
        if named and os.path.exists(file) and os.path.samefile(file, path):
            return True
    return False


def _import_file(path: str) -> None:
    """Import a ``.py`` file once per process under a name derived from its path; a file already loaded
    (the script running as ``__main__``, say) has registered its families and is not run a second time."""
    if _already_imported(path):
        return
    digest = hashlib.sha1(os.path.realpath(path).encode()).hexdigest()[:10]
    name = f"megacann_user_{os.path.splitext(os.path.basename(path))[0]}_{digest}"
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def import_family_modules(imports: Iterable[str], source: str = "<recipe>") -> None:
    """Import the modules of ``experiment.imports`` (already resolved), so their families register."""
    for entry in imports:
        try:
            if _is_path(entry):
                _import_file(entry)
            else:
                importlib.import_module(entry)
        except ConfigError:
            raise
        except Exception as err:
            raise ConfigError(
                f"{source}: experiment.imports: importing {entry!r} failed: {type(err).__name__}: {err}"
            ) from err


def model_config_class(family: str, source: str = "<recipe>") -> type[ModelConfig]:
    """The configuration class of ``family``; a ConfigError lists the known families."""
    if family not in _CONFIG_CLASSES:
        _load_entry_points()
    if family not in _CONFIG_CLASSES:
        raise ConfigError(
            f"{source}: model.type {family!r} is not a registered model family; registered: "
            f"{', '.join(known_families()) or 'none'} (name the module that registers it in experiment.imports)"
        )
    return _CONFIG_CLASSES[family]


def family_of_hf_model_type(model_type: Optional[str]) -> Optional[str]:
    """The family whose Hugging Face adapter reads config.json's ``model_type``, if any."""
    if model_type is None:
        return None
    if model_type not in _HF_MODEL_TYPES:
        _load_entry_points()
    return _HF_MODEL_TYPES.get(model_type)


def hf_model_types() -> list[str]:
    """Every config.json ``model_type`` a registered family reads."""
    _load_entry_points()
    return sorted(_HF_MODEL_TYPES)


def families_with_key(key: str) -> list[str]:
    """The registered families whose configuration has ``key`` (for "that key belongs to ..." hints)."""
    _load_entry_points()
    return [name for name, cls in sorted(_CONFIG_CLASSES.items()) if key in {f.name for f in dataclasses.fields(cls)}]


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


def model_config_from_dict(
    values: dict[str, Any], source: str = "<model settings>", imports: Iterable[str] = ()
) -> ModelConfig:
    """A family's model configuration from stored settings (a checkpoint's, a consolidated directory's);
    ``imports``: the modules that register its family when it is not megacann's. Keys the family does not
    know are left out."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: expected a mapping of model settings, got {type(values).__name__}")
    family = values.get("type") or DEFAULT_FAMILY
    if family not in _CONFIG_CLASSES:
        import_family_modules(imports, source)
    cls = model_config_class(family, source)
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in known})


def switch_family(model: ModelConfig, family: str, source: str) -> ModelConfig:
    """``model`` as a configuration of ``family`` (``model.type`` overridden): the shared keys carry over; a
    key set away from its default that the new family does not have is an error."""
    cls = model_config_class(family, source)
    if type(model) is cls:
        model.type = family
        return model
    new_fields = {f.name for f in dataclasses.fields(cls)}
    defaults = type(model)()
    values = {}
    for f in dataclasses.fields(model):
        value = getattr(model, f.name)
        if f.name == "type":
            continue
        if f.name in new_fields:
            values[f.name] = value
        elif value != getattr(defaults, f.name):
            raise ConfigError(f"{source}: model.{f.name} is a key of model family {model.type!r}, not of {family!r}")
    return cls(**values, type=family)
