"""The model contract: what the trainer, pipeline, optimizer, checkpoints, dry run and converter know
about a model family, and the registry that ``model.type`` picks from.

A family is one :class:`ModelSpec`:

- ``build_chunk(cfg, placement, device)`` builds the part of the model a pipeline stage holds for one of
  its (virtual) chunks: the layers of ``placement.layer_ids`` (global indices), the input embedding when
  ``placement.pre_process`` and the head when ``placement.post_process``, initialised from ``cfg.seed``
  the same way whatever the layout (name parameters by their global place and use
  :func:`megacann.layers.initialize_weights`).
- ``forward_step(chunk, batch, hidden_states)`` runs one micro-batch through a chunk and returns a
  :class:`~megacann.models.contract.ChunkOutput`: hidden states out of a chunk without the head, the per-token
  loss out of the last one, auxiliary losses out of any (Megatron-Core's ``forward_step_func``).
- ``flops_per_token`` from the config alone (MFU); ``num_parameters`` likewise (the dry run; without it
  the whole model is built on the meta device and counted), ``active_parameters`` where fewer take part
  per token (MoE).
- ``fill_defaults`` / ``check_config`` fill the family's defaults and check what only the family knows;
  ``hf`` optionally converts to and from Hugging Face checkpoints; ``after_optimizer_step(chunks)`` runs
  after every optimizer update (e.g. an MoE router's load-balancing bias); ``metric_warnings(record)``
  returns lines the console warns with after a logged step (e.g. an expert far from its fair share).
- ``config_class``: the family's configuration, a dataclass derived from :class:`ModelConfig` holding the
  family's own architecture keys (the recipe's ``model`` section and config.json are read into it; a key
  of another family is refused by name). Mark a field ``metadata={"shape": True}`` when it decides
  tensor shapes, ``{"architecture": True}`` when the weights a run starts from fix it, and give
  ``{"choices": (...)}`` for a closed set of values; extend ``HF_KEYS`` for its config.json names.
- ``decode(chunk, input_ids, position_ids)``: what :mod:`megacann.generation` calls to generate: the
  logits ``[b, s', vocab]`` of new tokens at their positions (the last ``s'`` >= 1 of them; the generator
  reads the last), the chunk's attention layers reading earlier tokens from the key/value caches the
  generator set on them; None: the family cannot generate (refused by name). To generate on pipeline
  stages it takes ``hidden_states`` too (from the previous stage, None on the first) and returns the
  stage's hidden states on a stage without the head.
- ``decode_cache(cfg)``: what each layer keeps while generating, one
  :mod:`~megacann.models.decode_cache` entry a layer (keys and values with their window, a compressed
  latent, a recurrent state); None: keys and values of the common keys in every layer. The generation
  cache's byte formulas and the planners' cache lines read it (:meth:`ModelSpec.decode_cache_layout`).
- ``mixture_of_experts``: the family may hold expert-parallel parameters; for any other family
  ``distributed.expert_parallel_size`` must be 1 (:func:`prepare_model_config` refuses it otherwise).
- ``sharding_units``: the module classes whose instances ZeRO-3 gathers and frees as one unit each
  (:mod:`megacann.optimizer.zero.units`; megacann's families: their transformer blocks); a chunk's weights
  outside them form one more unit. A family of its own blocks names their class, else its whole chunk is
  one unit and ZeRO-3 holds all of its weights whole during the chunk's forward and backward.
- ``architecture`` (a ``DecoderArch``) and, for an MoE family, ``moe_structure(cfg)`` (a
  :class:`MoEStructure`): what estimators such as ``megacann-plan`` need of the family's structure; a
  family without a ``DecoderArch`` gives ``rank_parameters`` (:class:`RankParameterFormulas`) instead,
  with its saved activations (:class:`ActivationFormulas`).

Register a family with :func:`register_model` (``model.type`` then names it; a recipe names the module
that registers it in ``experiment.imports`` so every rank and tool knows it), or hand a spec to
``Trainer(cfg, model_spec=...)``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from megacann import parallel_state as ps
from megacann.accelerator import PRECISION_DTYPES
from megacann.config import ConfigError, MegacannConfig, ModelConfig, register_model_config
from megacann.config.families import family_of_hf_model_type, hf_model_types
from megacann.layers.context import LayerContext
from megacann.layers.sharding import get_sharding
from megacann.layers.transformer import TransformerBlock
from megacann.models.contract import ChunkOutput
from megacann.models.decode_cache import LayerCache, attention_cache_layout
from megacann.models.mtp import check_mtp_config
from megacann.ops.fp8 import Fp8Settings

Device = Optional[Union[torch.device, str]]
Batch = dict[str, torch.Tensor]


def layer_context_from_config(cfg: MegacannConfig, device: Device = None) -> LayerContext:
    """The layer context (:class:`~megacann.layers.LayerContext`) of a recipe on this process, made here
    because the layers know no recipe: ``distributed.sequence_parallel`` (off under tp 1, read from
    parallel_state), ``model.precision``, ``distributed.context_parallel_algo``, ``model.init_method_std``
    and ``model.num_layers`` (scaled init), ``model.activation_checkpointing``,
    ``distributed.tp_comm_overlap``, ``precision.fp8``; ``device`` as given (the ``device`` a ``build_chunk`` receives)."""
    model, parallel = cfg.model, cfg.distributed
    return LayerContext(
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=PRECISION_DTYPES[model.precision],
        device=device,
        context_parallel_algo=parallel.context_parallel_algo,
        init_method_std=model.init_method_std,
        num_layers=model.num_layers,
        recompute=model.activation_checkpointing,
        tp_comm_overlap=parallel.tp_comm_overlap,
        fp8=fp8_settings(cfg),
    )


def fp8_settings(cfg: MegacannConfig) -> Optional[Fp8Settings]:
    """``precision.fp8`` and its keys as the layers take them (None: ``none``)."""
    p = cfg.precision
    if p.fp8 == "none":
        return None
    return Fp8Settings(
        p.fp8,
        p.fp8_grad_format,
        p.fp8_exclude_first_layers,
        p.fp8_exclude_last_layers,
        cfg.model.num_layers,
        p.fp8_scaling,
        p.fp8_amax_history_len,
        token_group=ps.get_context_parallel_group() if cfg.distributed.context_parallel_size > 1 else None,
    )


@dataclass(frozen=True)
class ChunkPlacement:
    """Where a model chunk sits: its layers (global indices) and whether it holds the input embedding
    (the model's first chunk) and the head (the model's last chunk)."""

    layer_ids: tuple[int, ...]
    pre_process: bool = True
    post_process: bool = True


def decoder_forward_step(chunk: torch.nn.Module, batch: Batch, hidden_states: Optional[torch.Tensor]) -> ChunkOutput:
    """The forward step of a model whose ``forward`` takes megacann's batch keys (``DecoderLM`` and any
    model with its signature): hidden states out of a middle chunk, the per-token loss out of the last."""
    out = chunk(
        input_ids=batch["tokens"],
        position_ids=batch.get("position_ids"),
        labels=batch.get("labels"),
        segment_ids=batch.get("segment_ids"),
        hidden_states=hidden_states,
    )
    if isinstance(out, ChunkOutput):
        return out
    if getattr(chunk, "post_process", True):
        return ChunkOutput(token_loss=out)
    return ChunkOutput(hidden_states=out)


@dataclass(frozen=True)
class HFAdapter:
    """Conversion between a family's whole tensors (megacann names) and a Hugging Face checkpoint.

    ``model_types``: the ``model_type`` values of config.json this adapter reads.
    ``config_from_hf(config_file, raw=None)`` maps a config.json onto a :class:`ModelConfig` (keyword
    ``raw``: the file as already parsed, else read; errors name ``config_file``); ``config_to_hf`` writes one. ``to_hf``
    renames (and splits fused) tensors; ``from_hf(names, read, cfg)`` returns the whole tensors of megacann ``names`` using
    ``read(hf_name)``. ``linear_parts(name, cfg)`` (optional) gives the Hugging Face names of a megacann
    linear weight with the output rows of each, in order (a fused weight is several, split by rows; rows
    None: the whole weight): what PEFT adapter names need (:mod:`megacann.interop.peft`).
    ``fit_to_weights(cfg, holds, source)`` (optional) adjusts settings the checkpoint's weights decide
    (``holds(hf_name)``: whether it has that tensor; a family's adapter reads no file itself).
    ``checkpoint_buffers(name)`` (optional): whether the persistent buffer of megacann name ``name`` is
    stored in the checkpoint beside the weights (DeepSeek-V4's hash-routing tables), so that it is read
    with them; other buffers keep the values the model is built with.
    ``lora_b_to_hf(name, b, cfg)`` (optional) lays a LoRA's ``B`` on megacann weight ``name`` out on the
    rows of the Hugging Face module ``linear_parts`` names for it, where Hugging Face regroups the rows.
    ``peft_refusal(targets)`` (optional): why PEFT cannot hold LoRAs on those targets of this family (None:
    it can); a LoRA run with them is refused at start-up.
    """

    model_types: tuple[str, ...]
    config_from_hf: Callable[..., ModelConfig]
    config_to_hf: Callable[[ModelConfig, torch.dtype], dict[str, Any]]
    to_hf: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]
    from_hf: Callable[[Sequence[str], Callable[[str], torch.Tensor], ModelConfig], dict[str, torch.Tensor]]
    linear_parts: Optional[Callable[[str, ModelConfig], list[tuple[str, Optional[int]]]]] = None
    fit_to_weights: Optional[Callable[[ModelConfig, Callable[[str], bool], str], None]] = None
    checkpoint_buffers: Optional[Callable[[str], bool]] = None
    lora_b_to_hf: Optional[Callable[[str, torch.Tensor, ModelConfig], torch.Tensor]] = None
    peft_refusal: Optional[Callable[[Sequence[str]], Optional[str]]] = None


@dataclass(frozen=True)
class MoEStructure:
    """The mixture-of-experts part of a decoder, as estimators need it: which layers are MoE layers
    (``moe_layers[i]``; the others have the dense MLP), ``num_experts`` routed SwiGLU experts of width
    ``expert_ffn_hidden_size`` each (split over TP like a dense MLP, spread over expert parallelism), each
    token routed to ``top_k`` of them (their weights renormalised when ``normalize_top_k``; at most
    ``capacity_factor`` times the even share per expert, None: dropless), a router of
    ``num_experts x hidden`` weights, and one shared SwiGLU MLP of width ``shared_ffn_hidden_size``
    (0: none) every token passes through, its output weighed per token by ``sigmoid(x · g)`` of a learned
    row g when ``shared_expert_gate`` (Qwen3.5-MoE)."""

    moe_layers: tuple[bool, ...]
    num_experts: int
    expert_ffn_hidden_size: int
    top_k: int
    shared_ffn_hidden_size: int = 0
    capacity_factor: Optional[float] = None
    normalize_top_k: bool = True
    shared_expert_gate: bool = False
    router_bias: bool = False  # a bias on the router's scores (gpt-oss): E parameters, dense
    expert_bias: bool = False  # biases on every expert's projections (gpt-oss): 2 f_e + h per expert
    clamped_activation: bool = False  # the clamped SwiGLU (gpt-oss, DeepSeek-V4; routed and shared experts):
    # five f-wide tensors saved a row, not two
    score_function: str = "softmax"  # the router's scores: sqrtsoftplus (DeepSeek-V4) saves its logits too


def _no_defaults(cfg: ModelConfig) -> None:
    return None


def _no_checks(cfg: MegacannConfig, source: str) -> None:
    return None


@dataclass(frozen=True)
class ActivationShape:
    """What a layer's saved activations depend on besides the model: ``micro_batch`` sequences of
    ``seq_length`` tokens (the whole sequence; a context-parallel rank holds ``seq_length / cp`` of each),
    ``tp`` ranks splitting the heads, ``sequence_parallel`` (the tokens between attention blocks split over
    them), ``dtype_bytes`` of the weights' dtype."""

    micro_batch: int
    seq_length: int
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    dtype_bytes: int = 4


@dataclass(frozen=True)
class ActivationFormulas:
    """Saved-activation bytes of a family that is not a standard decoder, for ``megacann-plan`` (which adds
    the pipeline's in-flight micro-batches, the token ids, the output layer's input and the loss, and the
    MoE feed-forward blocks from :mod:`megacann.planning.moe`). Every count is for one micro-batch on one
    rank (:class:`ActivationShape`), by what saves them:

    - ``kind(m, layer_id)``: a label of the layer's kind; layers of one kind save the same bytes;
    - ``layer(m, shape, layer_id, recompute)``: the layer's terms but its MoE block's, with ``recompute``
      ``none`` or ``selective`` (the recipe's ``model.activation_checkpointing``);
    - ``full(m, shape, layer_id)``: what a layer keeps under ``full`` recompute (its input);
    - ``moe(m, layer_id)``: the layer's MoE block (None: none);
    - ``head(m, shape)``: the last chunk's terms before its output layer (final norm and the like);
    - ``shared(m, shape, recompute)``: what a chunk's layers save once between them (a tensor every layer
      reads and saves, e.g. the batch's position ids), on any chunk with layers."""

    kind: Callable[[ModelConfig, int], str]
    layer: Callable[[ModelConfig, ActivationShape, int, str], dict[str, float]]
    full: Callable[[ModelConfig, ActivationShape, int], float]
    moe: Callable[[ModelConfig, int], Optional[MoEStructure]]
    head: Callable[[ModelConfig, ActivationShape], dict[str, float]]
    shared: Optional[Callable[[ModelConfig, ActivationShape, str], dict[str, float]]] = None


@dataclass(frozen=True)
class RankParameterFormulas:
    """Per-rank parameter counts of a family that is not a standard decoder (no ``DecoderArch``):
    ``megacann-plan`` gives its weights, gradients and optimizer state per pipeline stage from them.
    ``layer(m, tp, layer_id, ep)``: (dense, expert) parameters of one layer on one TP rank of one
    expert-parallel rank; ``head(m)``: the last stage's parameters besides the output layer (final norm
    and the like); ``fp32(m, tp, layer_ids, last)``: how many of those layers' (and, when ``last``, the
    head's) parameters stay fp32 in a bf16 / fp16 model (no master copy). ``activations``: its saved
    activations (:class:`ActivationFormulas`); None: ``megacann-plan`` refuses an activation estimate by name."""

    layer: Callable[[ModelConfig, int, int, int], tuple[int, int]]
    head: Callable[[ModelConfig], int]
    fp32: Callable[[ModelConfig, int, list[int], bool], int]
    activations: Optional[ActivationFormulas] = None


@dataclass(frozen=True)
class ModelSpec:
    """One model family. Only ``name``, ``build_chunk`` and ``flops_per_token`` are required; see the
    module docstring for each field."""

    name: str
    build_chunk: Callable[[MegacannConfig, ChunkPlacement, Device], torch.nn.Module]
    flops_per_token: Callable[[ModelConfig, int], float]
    num_parameters: Optional[Callable[[ModelConfig], int]] = None
    forward_step: Callable[[torch.nn.Module, Batch, Optional[torch.Tensor]], ChunkOutput] = decoder_forward_step
    active_parameters: Optional[Callable[[ModelConfig], int]] = None
    fill_defaults: Callable[[ModelConfig], None] = _no_defaults
    check_config: Callable[[MegacannConfig, str], None] = _no_checks
    hf: Optional[HFAdapter] = None
    architecture: Any = None  # what estimators need of its structure (a DecoderArch); None: no memory plan
    moe_structure: Optional[Callable[[ModelConfig], MoEStructure]] = None  # its MoE layers (MoE families)
    rank_parameters: Optional[RankParameterFormulas] = None  # no DecoderArch: its own memory formulas
    after_optimizer_step: Optional[Callable[[list[torch.nn.Module]], None]] = None
    metric_warnings: Optional[Callable[[dict[str, Any]], list[str]]] = None
    mixture_of_experts: bool = False
    decode: Optional[Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = None
    decode_cache: Optional[Callable[[ModelConfig], list[LayerCache]]] = None  # None: keys and values a layer
    config_class: type[ModelConfig] = ModelConfig
    sharding_units: tuple[type[torch.nn.Module], ...] = (TransformerBlock,)

    def build(self, cfg: MegacannConfig, placement: ChunkPlacement, device: Device = None) -> torch.nn.Module:
        """``build_chunk`` inside the recipe's layer context (sequence parallel, dtype, device, the
        context-parallel algorithm, init): every layer the family builds gets the recipe's settings, even
        one a family forgot to pass them to. What megacann calls to build a chunk."""
        with layer_context_from_config(cfg, device):
            return self.build_chunk(cfg, placement, device)

    def total_parameters(self, cfg: ModelConfig) -> int:
        """Parameters of the whole model (vocabulary unpadded), from the family's formula or by counting."""
        if self.num_parameters is not None:
            return self.num_parameters(cfg)
        recipe = MegacannConfig(model=dataclasses.replace(cfg))  # a copy, of the family's class
        self.fill_defaults(recipe.model)
        with torch.device("meta"):  # no memory, no initialisation cost
            model = self.build(recipe, ChunkPlacement(tuple(range(cfg.num_layers))), "meta")
        return sum(math.prod(get_sharding(p).logical_shape) for p in model.parameters())

    def decode_cache_layout(self, cfg: ModelConfig) -> list[LayerCache]:
        """What each of the model's layers caches while generating (the family's ``decode_cache``, else
        keys and values of the common keys); a ValueError for a family without a decode path."""
        if self.decode is None:
            raise ValueError(f"model family {self.name!r} has no decode path (ModelSpec.decode): it caches nothing")
        return (self.decode_cache or attention_cache_layout)(cfg)

    def parameters_per_token(self, cfg: ModelConfig) -> int:
        """Parameters a token meets (all of them, unless the family says fewer: MoE)."""
        return self.active_parameters(cfg) if self.active_parameters else self.total_parameters(cfg)


_REGISTRY: dict[str, ModelSpec] = {}
_REGISTERED_FROM: dict[str, str] = {}  # family -> the file whose code registered it
_REGISTERING_MODULE: dict[str, str] = {}  # family -> that code's module name


def register_model(spec: ModelSpec, *, replace: bool = False) -> ModelSpec:
    """Make ``spec`` available as ``model.type: <spec.name>``; returns it (usable as a one-liner)."""
    frame = sys._getframe(1)
    caller = os.path.realpath(frame.f_code.co_filename)
    known = _REGISTRY.get(spec.name)
    # the same file imported twice (a script, then by experiment.imports under another module name)
    # registers its family again; a rival family of that name from elsewhere is an error
    if known is not None and not replace and known is not spec and _REGISTERED_FROM.get(spec.name) != caller:
        raise ValueError(f"a model family named {spec.name!r} is already registered (pass replace=True)")
    register_model_config(spec.name, spec.config_class, spec.hf.model_types if spec.hf else ())
    _REGISTERED_FROM[spec.name] = caller
    _REGISTERING_MODULE[spec.name] = frame.f_globals.get("__name__", "")
    _REGISTRY[spec.name] = spec
    return spec


def family_import(name: str) -> Optional[str]:
    """What another process imports to know family ``name`` (an ``experiment.imports`` entry): nothing for
    megacann's own families, the module's name when it is importable by name, else its file (a script run
    as ``__main__``, or a file imported by path)."""
    module, file = _REGISTERING_MODULE.get(name, ""), _REGISTERED_FROM.get(name)
    if file is None or module == "megacann" or module.startswith("megacann."):
        return None
    return file if module == "__main__" or module.startswith("megacann_user_") or not module else module


def registered_models() -> list[str]:
    return sorted(_REGISTRY)


def get_model_spec(name: str, source: str = "<recipe>") -> ModelSpec:
    """The registered family ``name``; a ConfigError lists the registered ones."""
    if name not in _REGISTRY:
        raise ConfigError(
            f"{source}: model.type {name!r} is not a registered model family; registered: "
            f"{', '.join(registered_models())} (a script adds its own with megacann.models.register_model)"
        )
    return _REGISTRY[name]


def prepare_model_config(cfg: MegacannConfig, spec: Optional[ModelSpec] = None, source: str = "<recipe>") -> ModelSpec:
    """Fill the family's defaults into ``cfg.model`` and run its checks, plus the checks every family
    shares; returns the spec. Idempotent."""
    spec = spec or get_model_spec(cfg.model.type, source)
    if not isinstance(cfg.model, spec.config_class):  # a spec handed in by hand, with keys of its own
        cfg.model = _as_config_class(cfg.model, spec.config_class, spec.name, source)
    spec.fill_defaults(cfg.model)
    m, tp = cfg.model, cfg.distributed.tensor_parallel_size
    if m.ffn_hidden_size is not None and m.ffn_hidden_size % tp:
        raise ConfigError(
            f"{source}: model.ffn_hidden_size {m.ffn_hidden_size} is not divisible by "
            f"distributed.tensor_parallel_size {tp}"
        )
    if not spec.mixture_of_experts:
        refuse_expert_settings(cfg, spec.name, source)
    check_mtp_config(cfg, source)  # a family whose config has multi-token prediction's keys
    spec.check_config(cfg, source)
    return spec


def _as_config_class(model: ModelConfig, config_class: type[ModelConfig], family: str, source: str) -> ModelConfig:
    """``model``'s settings in ``config_class`` (its own keys at their defaults); refused when ``model`` has
    keys that class lacks."""
    names = {f.name for f in dataclasses.fields(config_class)}
    extra = [f.name for f in dataclasses.fields(model) if f.name not in names]
    if extra:
        raise ConfigError(f"{source}: model family {family!r} has no model key(s) {', '.join(extra)}")
    return config_class(**{f.name: getattr(model, f.name) for f in dataclasses.fields(model)})


def refuse_expert_settings(cfg: MegacannConfig, family: str, source: str = "<recipe>") -> None:
    """A family without experts has nothing to spread over expert-parallel ranks: refuse the setting."""
    ep = cfg.distributed.expert_parallel_size
    if ep != 1:
        raise ConfigError(
            f"{source}: distributed.expert_parallel_size: {ep} is refused: model family {family!r} has no "
            "experts to spread (expert parallelism needs a mixture-of-experts family such as model.type: moe)"
        )


def find_hf_family(model_type: str) -> ModelSpec:
    """The registered family whose Hugging Face adapter reads config.json's ``model_type`` (the recipe
    loader's map, :func:`megacann.config.families.family_of_hf_model_type`: the one map of them)."""
    family = family_of_hf_model_type(model_type)
    if family is None:
        raise ConfigError(
            f"Hugging Face model_type {model_type!r} has no megacann adapter; readable: {', '.join(hf_model_types())}"
        )
    return get_model_spec(family)
