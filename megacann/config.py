"""Training recipes: dataclasses for every section, YAML loading, dotted overrides and validation.

A recipe is a YAML file with the sections of :class:`MegacannConfig`. Unknown keys, wrong types and
inconsistent parallel sizes are errors that name the file, the key, the value and what was expected
(with the closest valid key for a typo). A model may be given inline or through ``model.config_path``,
a Hugging Face style ``config.json`` whose keys are mapped onto :class:`ModelConfig`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import yaml


class ConfigError(ValueError):
    """A recipe that cannot be used as written."""


@dataclass
class ExperimentConfig:
    name: str = "megacann"
    output_dir: str = "./output"


@dataclass
class ModelConfig:
    """Architecture and numerics. Sizes may come from ``config_path`` (HF config.json); inline keys win."""

    type: str = "llama"  # llama | gpt | moe
    config_path: Optional[str] = None
    precision: str = "bf16"  # bf16 | fp16 | fp32
    hidden_size: Optional[int] = None
    num_layers: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None  # None: same as num_attention_heads (no GQA)
    ffn_hidden_size: Optional[int] = None  # None: 4*hidden (gpt) or LLaMA's 2/3*4*hidden rounded to 256
    vocab_size: Optional[int] = None  # None: taken from the tokenizer
    max_position_embeddings: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # Llama-3 style: {rope_type: llama3, factor, low_freq_factor, ...}
    rotary_interleaved: bool = False
    tie_word_embeddings: bool = False
    add_bias_linear: Optional[bool] = None  # None: True for gpt, False for llama
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    activation_checkpointing: str = "none"  # none | selective | full

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads  # type: ignore[return-value]

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        assert self.hidden_size is not None
        if self.type == "gpt":
            return 4 * self.hidden_size
        return 256 * ((int(2 * 4 * self.hidden_size / 3) + 255) // 256)

    @property
    def use_bias(self) -> bool:
        return self.add_bias_linear if self.add_bias_linear is not None else self.type == "gpt"


@dataclass
class DataConfig:
    path: Optional[Union[str, list]] = None  # None: the embedded default corpus (stdlib sources)
    tokenizer: Optional[str] = None  # None: byte-level BPE trained on the default corpus and cached
    seq_length: int = 2048
    batch_size: int = 1  # micro-batch per device
    num_workers: int = 2
    persistent_workers: bool = False
    pin_memory: Optional[bool] = None  # None: pin when the device supports it
    split: str = "98,2,0"  # train, validation, test weights
    weights: Optional[list] = None  # blending weights, one per entry of `path`
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    tokenizer_vocab_size: int = 8192  # vocabulary of the BPE trained on the default corpus
    cache_dir: Optional[str] = None  # index / tokenizer caches; None: next to the data
    json_key: str = "text"
    prompt_template: str = "alpaca"
    skip_bad_lines: bool = False
    pack_sft: bool = True


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adam | sgd
    lr: float = 3.0e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1.0e-8
    scheduler: str = "cosine"  # cosine | linear | constant
    warmup_ratio: float = 0.0
    warmup_steps: Optional[int] = None  # wins over warmup_ratio when set
    min_lr_ratio: float = 0.1
    grad_accum_steps: int = 1
    max_steps: int = 1000
    clip_grad: float = 1.0  # 0 disables clipping
    initial_loss_scale: float = 65536.0  # fp16 dynamic loss scaling
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0


@dataclass
class DistributedConfig:
    world_size: Optional[int] = None  # None: from torchrun (WORLD_SIZE) or 1
    parallel_mode: str = "hybrid"  # data | tensor | pipeline | hybrid
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: Optional[int] = None  # None: world / (tp * pp * cp)
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    virtual_pipeline_size: Optional[int] = None
    sequence_parallel: bool = False
    pipeline_layers: Optional[list] = None  # layers per (virtual) stage; None: even split
    zero_optimization: Union[bool, int] = False  # false | true (=1) | 1 | 2
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size_mb: float = 40.0
    device: Optional[str] = None  # npu | cuda | cpu; None: auto (MEGACANN_DEVICE wins)
    timeout_minutes: float = 30.0

    @property
    def zero_stage(self) -> int:
        z = self.zero_optimization
        return int(z) if not isinstance(z, bool) else (1 if z else 0)


@dataclass
class LoggingConfig:
    log_interval: int = 10
    ckpt_interval: int = 1000  # 0: save only at the end
    keep_last: Optional[int] = None  # None: keep all
    eval_interval: int = 0  # 0: no evaluation during training
    eval_iters: int = 10
    wandb: bool = False
    wandb_project: Optional[str] = None
    tensorboard: bool = False
    async_save: bool = False
    timers: bool = False  # per-stage forward/backward/communication timing


@dataclass
class PrecisionConfig:
    fp32_ops: list = field(default_factory=list)  # op names forced to fp32 (e.g. softmax, loss)
    fused_ops: Union[bool, list] = True  # true: every available fused op; list: only those


@dataclass
class MegacannConfig:
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    seed: int = 1234
    train_mode: str = "pretrain"  # pretrain | sft
    lora: bool = False
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    @property
    def global_batch_size(self) -> int:
        dp = self.distributed.data_parallel_size or 1
        return self.data.batch_size * dp * self.optim.grad_accum_steps

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


_SECTION_CLASSES = {
    "experiment": ExperimentConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "distributed": DistributedConfig,
    "logging": LoggingConfig,
    "precision": PrecisionConfig,
}
TOP_LEVEL_KEYS = [f.name for f in dataclasses.fields(MegacannConfig) if f.name not in _SECTION_CLASSES]

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
}
# Aliases accepted inline in the recipe's model section too (HF names are familiar to users).
MODEL_ALIASES = {k: v for k, v in HF_MODEL_KEYS.items() if k != v}

CHOICES = {
    "model.type": ("llama", "gpt", "moe"),
    "model.precision": ("bf16", "fp16", "fp32"),
    "model.activation_checkpointing": ("none", "selective", "full"),
    "optim.name": ("adamw", "adam", "sgd"),
    "optim.scheduler": ("cosine", "linear", "constant"),
    "distributed.parallel_mode": ("data", "tensor", "pipeline", "hybrid"),
    "train_mode": ("pretrain", "sft"),
}


def all_dotted_keys() -> list[str]:
    keys = list(TOP_LEVEL_KEYS)
    for section, cls in _SECTION_CLASSES.items():
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def suggest_key(dotted: str) -> Optional[str]:
    """The closest valid dotted key for a misspelt or foreign one."""
    leaf = dotted.split(".")[-1]
    if leaf in SYNONYMS:
        return SYNONYMS[leaf]
    keys = all_dotted_keys()
    section = dotted.split(".")[0] if "." in dotted else None
    same_section = [k for k in keys if section and k.startswith(section + ".")]
    leaves = {k.split(".")[-1]: k for k in same_section}
    match = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)
    if match:
        return leaves[match[0]]
    match = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.6)
    if match:
        return match[0]
    by_leaf = {k.split(".")[-1]: k for k in keys}
    match = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
    return by_leaf[match[0]] if match else None


def _unknown_key(dotted: str, source: str) -> ConfigError:
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
        if key in HF_MODEL_KEYS:
            mapped[HF_MODEL_KEYS[key]] = value
        elif key in {f.name for f in dataclasses.fields(ModelConfig)}:
            mapped[key] = value
        elif key not in HF_IGNORED_KEYS:
            warnings.warn(f"{path}: model key '{key}' is not used by megacann and is ignored", stacklevel=3)
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
            raise _unknown_key(f"{section}.{key}", source)
        _set_field(obj, name, value, f"{section}.{key}", source)


def config_from_dict(raw: dict, source: str = "<recipe>", base_dir: Optional[str] = None) -> MegacannConfig:
    """Build a config from a parsed recipe; ``source`` names the file in error messages."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a recipe must be a mapping of sections, got {type(raw).__name__}")
    cfg = MegacannConfig()
    model_raw = raw.get("model") or {}
    if isinstance(model_raw, dict) and model_raw.get("config_path"):
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


def load_config(path: str, overrides: Optional[list[str]] = None, world_size: Optional[int] = None) -> MegacannConfig:
    """Load, override and validate a recipe. ``world_size`` is the runtime world (torchrun), if known."""
    if not os.path.exists(path):
        raise ConfigError(f"recipe not found: {path!r}")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
    cfg = config_from_dict(raw, source=path, base_dir=os.path.dirname(os.path.abspath(path)))
    apply_overrides(cfg, overrides or [])
    validate(cfg, world_size=world_size, source=path)
    return cfg


# -- validation ------------------------------------------------------------------------------------


def resolve_parallel_sizes(cfg: MegacannConfig, world_size: Optional[int], source: str) -> None:
    """Fill in world_size / data_parallel_size and check tp x cp x pp x dp = world."""
    d = cfg.distributed
    model = d.tensor_parallel_size * d.pipeline_parallel_size * d.context_parallel_size
    if world_size is not None and d.world_size is not None and world_size != d.world_size:
        raise ConfigError(f"{source}: distributed.world_size is {d.world_size} but {world_size} processes were started")
    world = world_size if world_size is not None else d.world_size
    if d.data_parallel_size is None and world is not None:
        if world % model:
            raise ConfigError(
                f"{source}: world_size {world} is not divisible by tensor_parallel_size "
                f"{d.tensor_parallel_size} x pipeline_parallel_size {d.pipeline_parallel_size} x "
                f"context_parallel_size {d.context_parallel_size} = {model}"
            )
        d.data_parallel_size = world // model
    if d.data_parallel_size is not None:
        product = model * d.data_parallel_size
        if world is not None and product != world:
            raise ConfigError(
                f"{source}: world_size {world} != tensor_parallel_size {d.tensor_parallel_size} x "
                f"pipeline_parallel_size {d.pipeline_parallel_size} x data_parallel_size "
                f"{d.data_parallel_size} x context_parallel_size {d.context_parallel_size} = {product}"
            )
        world = product
    d.world_size = world


def _check_choice(cfg: MegacannConfig, dotted: str, source: str) -> None:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    if obj not in CHOICES[dotted]:
        raise ConfigError(f"{source}: {dotted}: {obj!r} is not one of {', '.join(CHOICES[dotted])}")


BUBBLE_WARNING = 0.25  # warn when a pipeline idles longer than this share of a step


def pipeline_bubble_fraction(pipeline_size: int, num_microbatches: int, virtual_size: Optional[int] = None) -> float:
    """Share of a step a pipeline stage idles in (1F1B): (p - 1)/(m + p - 1); interleaving divides the
    bubble time by v: ((p - 1)/v)/(m + (p - 1)/v)."""
    bubble = (pipeline_size - 1) / (virtual_size or 1)
    return bubble / (num_microbatches + bubble)


def interleaved_schedule_error(pipeline_size: int, virtual_size: int, num_microbatches: int) -> Optional[str]:
    """Why the interleaved 1F1B schedule cannot run this many micro-batches, or None when it can."""
    p, m = pipeline_size, num_microbatches
    if m % p == 0:
        return None
    lower, upper = m - m % p, m + p - m % p
    options = f"{lower} or {upper}" if lower else f"{upper}"
    return (
        f"the interleaved 1F1B schedule (virtual_pipeline_size {virtual_size}) needs the number of "
        f"micro-batches, optim.grad_accum_steps, to be a multiple of pipeline_parallel_size {p}, got {m}: "
        f"use {options}, or no virtual stages (1F1B takes any number)"
    )


def _check_pipeline(cfg: MegacannConfig, source: str) -> None:
    """Schedule constraints and the bubble warning (pipeline_layers and sizes are checked by validate)."""
    pp, vpp, m = (
        cfg.distributed.pipeline_parallel_size,
        cfg.distributed.virtual_pipeline_size or 1,
        cfg.optim.grad_accum_steps,
    )
    if pp < 2:
        return
    if vpp > 1:
        error = interleaved_schedule_error(pp, vpp, m)
        if error:
            raise ConfigError(f"{source}: {error}")
    bubble = pipeline_bubble_fraction(pp, m, vpp)
    if bubble > BUBBLE_WARNING:
        if vpp == 1:
            formula = f"(p - 1)/(m + p - 1) = {pp - 1}/{m + pp - 1}"
            remedy = "or set distributed.virtual_pipeline_size (interleaved 1F1B)"
        else:
            formula = f"((p - 1)/v)/(m + (p - 1)/v) with v {vpp} = {(pp - 1) / vpp:g}/{m + (pp - 1) / vpp:g}"
            remedy = "or a larger distributed.virtual_pipeline_size"
        warnings.warn(
            f"{source}: pipeline bubble {bubble:.0%} > {BUBBLE_WARNING:.0%}: pipeline_parallel_size p {pp} with "
            f"optim.grad_accum_steps m {m} micro-batches idles each stage {formula} of a step; use "
            f"grad_accum_steps {_microbatches_for_bubble(pp, vpp)} or more {remedy}",
            stacklevel=3,
        )


def _microbatches_for_bubble(pp: int, vpp: int) -> int:
    """The fewest micro-batches that keep the bubble at most BUBBLE_WARNING (a multiple of pp if interleaved)."""
    m = 1
    while pipeline_bubble_fraction(pp, m, vpp) > BUBBLE_WARNING or (vpp > 1 and m % pp):
        m += 1
    return m


def validate(cfg: MegacannConfig, world_size: Optional[int] = None, source: str = "<recipe>") -> None:
    """Check the recipe for consistency; fills derived values (data_parallel_size, world_size)."""
    for dotted in CHOICES:
        _check_choice(cfg, dotted, source)
    m, d, o = cfg.model, cfg.distributed, cfg.optim
    for key in ("hidden_size", "num_layers", "num_attention_heads"):
        if getattr(m, key) is None:
            raise ConfigError(f"{source}: model.{key} is not set (give it inline or through model.config_path)")
    positive = {
        "model.hidden_size": m.hidden_size,
        "model.num_layers": m.num_layers,
        "model.num_attention_heads": m.num_attention_heads,
        "model.num_key_value_heads": m.kv_heads,
        "data.seq_length": cfg.data.seq_length,
        "data.batch_size": cfg.data.batch_size,
        "optim.grad_accum_steps": o.grad_accum_steps,
        "optim.max_steps": o.max_steps,
        "distributed.tensor_parallel_size": d.tensor_parallel_size,
        "distributed.pipeline_parallel_size": d.pipeline_parallel_size,
        "distributed.context_parallel_size": d.context_parallel_size,
        "distributed.expert_parallel_size": d.expert_parallel_size,
        "logging.log_interval": cfg.logging.log_interval,
    }
    for key, value in positive.items():
        if value is None or value < 1:
            raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"{source}: model.hidden_size {m.hidden_size} is not divisible by "
            f"model.num_attention_heads {m.num_attention_heads}"
        )
    if m.num_attention_heads % m.kv_heads:
        raise ConfigError(
            f"{source}: model.num_attention_heads {m.num_attention_heads} is not divisible by "
            f"model.num_key_value_heads {m.kv_heads}"
        )
    tp, pp = d.tensor_parallel_size, d.pipeline_parallel_size
    if m.num_attention_heads % tp:
        raise ConfigError(
            f"{source}: model.num_attention_heads {m.num_attention_heads} is not divisible by "
            f"distributed.tensor_parallel_size {tp}"
        )
    if m.kv_heads % tp and tp % m.kv_heads:
        raise ConfigError(
            f"{source}: model.num_key_value_heads {m.kv_heads} must be a multiple or a divisor of "
            f"distributed.tensor_parallel_size {tp}"
        )
    if m.ffn_size % tp:
        raise ConfigError(
            f"{source}: model.ffn_hidden_size {m.ffn_size} is not divisible by distributed.tensor_parallel_size {tp}"
        )
    vpp = d.virtual_pipeline_size or 1
    if d.virtual_pipeline_size is not None and d.virtual_pipeline_size < 1:
        raise ConfigError(f"{source}: distributed.virtual_pipeline_size must be >= 1, got {d.virtual_pipeline_size}")
    if vpp > 1 and pp < 2:
        raise ConfigError(
            f"{source}: distributed.virtual_pipeline_size {vpp} needs pipeline_parallel_size > 1, got {pp}"
        )
    if d.pipeline_layers is not None:
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in d.pipeline_layers):
            raise ConfigError(
                f"{source}: distributed.pipeline_layers {d.pipeline_layers} must list non-negative layer counts"
            )
        if len(d.pipeline_layers) != pp * vpp or sum(d.pipeline_layers) != m.num_layers:
            raise ConfigError(
                f"{source}: distributed.pipeline_layers {d.pipeline_layers} must list {pp * vpp} stage sizes "
                f"(pipeline_parallel_size {pp} x virtual_pipeline_size {vpp}) summing to model.num_layers "
                f"{m.num_layers}"
            )
    elif m.num_layers % (pp * vpp):
        raise ConfigError(
            f"{source}: model.num_layers {m.num_layers} is not divisible by pipeline_parallel_size {pp} x "
            f"virtual_pipeline_size {vpp} = {pp * vpp} (or give distributed.pipeline_layers)"
        )
    _check_pipeline(cfg, source)
    mode = d.parallel_mode
    if mode == "data" and (tp > 1 or pp > 1):
        raise ConfigError(
            f"{source}: distributed.parallel_mode 'data' needs tensor_parallel_size 1 and pipeline_parallel_size 1, "
            f"got {tp} and {pp} (use 'hybrid')"
        )
    if mode == "tensor" and pp > 1:
        raise ConfigError(
            f"{source}: distributed.parallel_mode 'tensor' needs pipeline_parallel_size 1, got {pp} (use 'hybrid')"
        )
    if mode == "pipeline" and tp > 1:
        raise ConfigError(
            f"{source}: distributed.parallel_mode 'pipeline' needs tensor_parallel_size 1, got {tp} (use 'hybrid')"
        )
    if d.zero_optimization not in (False, True, 0, 1, 2):
        raise ConfigError(
            f"{source}: distributed.zero_optimization must be false, true, 1 or 2, got {d.zero_optimization!r}"
        )
    resolve_parallel_sizes(cfg, world_size, source)
    dp = d.data_parallel_size
    if dp is not None and dp % d.expert_parallel_size:
        raise ConfigError(
            f"{source}: distributed.expert_parallel_size {d.expert_parallel_size} does not divide "
            f"data_parallel_size {dp}"
        )
    if m.type == "gpt" and cfg.data.seq_length > m.max_position_embeddings:
        raise ConfigError(
            f"{source}: data.seq_length {cfg.data.seq_length} exceeds model.max_position_embeddings "
            f"{m.max_position_embeddings} (GPT uses learned positions)"
        )
    if not 0.0 <= o.warmup_ratio < 1.0:
        raise ConfigError(f"{source}: optim.warmup_ratio must be in [0, 1), got {o.warmup_ratio}")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"{source}: optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    if o.lr <= 0:
        raise ConfigError(f"{source}: optim.lr must be positive, got {o.lr}")
    if o.clip_grad < 0:
        raise ConfigError(f"{source}: optim.clip_grad must be >= 0 (0 disables clipping), got {o.clip_grad}")
