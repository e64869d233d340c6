"""Hugging Face LLaMA checkpoints (config.json + safetensors) to and from megacann's LlamaModel.

Offline only: a local directory is read or written. megacann's names are Hugging Face's without the
``model.`` prefix, except where megacann fuses projections (``mlp.gate_up_proj`` = gate then up;
``self_attn.qkv_proj`` = q, k, v), which are split and joined here.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.config import ConfigError, ModelConfig, load_hf_model_config
from megacann.models.full_state import full_state_dict, load_full_state_dict_
from megacann.models.llama import LlamaModel

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# -- names ------------------------------------------------------------------------------------------


def to_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megacann whole tensors -> Hugging Face names (fused projections split)."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q_size, kv_size = cfg.num_attention_heads * head_dim, cfg.kv_heads * head_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix = "" if name == "lm_head.weight" else "model."
        if ".mlp.gate_up_proj." in name:
            gate, up = torch.split(tensor, [cfg.ffn_size, cfg.ffn_size], dim=0)
            out[prefix + name.replace("gate_up_proj", "gate_proj")] = gate
            out[prefix + name.replace("gate_up_proj", "up_proj")] = up
        elif ".self_attn.qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), torch.split(tensor, [q_size, kv_size, kv_size])):
                out[prefix + name.replace("qkv_proj", part)] = piece
        else:
            out[prefix + name] = tensor
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_tensors(model: torch.nn.Module, read: Any) -> dict[str, torch.Tensor]:
    """The whole tensors ``model`` needs, read by Hugging Face name through ``read(hf_name)``."""
    out: dict[str, torch.Tensor] = {}
    for name, _ in model.named_parameters():
        prefix = "" if name == "lm_head.weight" else "model."
        if ".mlp.gate_up_proj." in name:
            parts = [read(prefix + name.replace("gate_up_proj", p)) for p in ("gate_proj", "up_proj")]
            out[name] = torch.cat(parts, dim=0)
        elif ".self_attn.qkv_proj." in name:
            parts = [read(prefix + name.replace("qkv_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
            out[name] = torch.cat(parts, dim=0)
        elif name == "lm_head.weight" and model.config.tie_word_embeddings:
            out[name] = read("model.embed_tokens.weight")
        else:
            out[name] = read(prefix + name)
    return out


# -- config -----------------------------------------------------------------------------------------


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.use_bias,
        "mlp_bias": False,
        "hidden_act": "silu",
        "initializer_range": cfg.init_method_std,
        "torch_dtype": DTYPE_NAMES.get(dtype, "float32"),
    }


def model_config_from_hf(path: str, **overrides: Any) -> ModelConfig:
    """A LLaMA ModelConfig from a Hugging Face directory's config.json (``overrides`` win)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
    values = load_hf_model_config(config_file)
    values.update(overrides)
    names = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{config_file}: unknown model settings {unknown}")
    values["type"] = "llama"
    values.setdefault("precision", "fp32")
    return ModelConfig(**values)


# -- reading ----------------------------------------------------------------------------------------


class SafetensorsReader:
    """Reads tensors by name from a single safetensors file or a sharded set with an index."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        index = os.path.join(path, SAFETENSORS_INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            with safe_open(os.path.join(path, SINGLE_FILE), framework="pt") as handle:
                weight_map = dict.fromkeys(handle.keys(), SINGLE_FILE)
        else:
            raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {SAFETENSORS_INDEX} found")
        self.weight_map = weight_map
        self._open = safe_open
        self._handles: dict[str, Any] = {}

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        file = self.weight_map[name]
        if file not in self._handles:
            full = os.path.join(self.path, file)
            if not os.path.isfile(full):
                raise FileNotFoundError(f"{self.path}: shard {file} named by the index is missing")
            self._handles[file] = self._open(full, framework="pt")
        return self._handles[file].get_tensor(name)


def from_pretrained_hf(
    path: str,
    precision: str = "fp32",
    device: Optional[Union[str, torch.device]] = None,
    sequence_parallel: bool = False,
    **overrides: Any,
) -> LlamaModel:
    """Build a LlamaModel (on this rank's tensor-parallel slice) with the weights of a local HF directory."""
    from megacann.models import PRECISION_DTYPES

    cfg = model_config_from_hf(path, precision=precision, **overrides)
    model = LlamaModel(
        cfg, sequence_parallel=sequence_parallel, params_dtype=PRECISION_DTYPES[precision], device=device
    )
    reader = SafetensorsReader(path)
    load_full_state_dict_([model], from_hf_tensors(model, reader), source=path)
    return model


# -- writing ----------------------------------------------------------------------------------------


def save_pretrained_hf(chunks: list[LlamaModel], path: str) -> None:
    """Write a Hugging Face LLaMA directory. Collective over the tensor-parallel group; with pipeline
    stages every stage writes its own safetensors shard and the first stage writes the index."""
    from safetensors.torch import save_file

    cfg = chunks[0].config
    tensors = to_hf_tensors(full_state_dict(chunks), cfg)
    dtype = next(iter(tensors.values())).dtype
    pp_size, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    writes = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    file = SINGLE_FILE if pp_size == 1 else f"model-{pp_rank + 1:05d}-of-{pp_size:05d}.safetensors"
    if writes:
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
    if pp_size > 1:
        names = [None] * pp_size
        dist.all_gather_object(names, (file, sorted(tensors)), group=ps.get_pipeline_model_parallel_group())
        if writes and pp_rank == 0:
            weight_map = {name: f for f, keys in names for name in keys}
            with open(os.path.join(path, SAFETENSORS_INDEX), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    if writes and pp_rank == 0:
        write_hf_config(path, cfg, dtype)


def write_hf_config(path: str, cfg: ModelConfig, dtype: torch.dtype) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, dtype), f, indent=1)


def save_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, path: str) -> None:
    """Write whole megacann tensors (held by one process, e.g. read from a checkpoint) as a Hugging Face
    LLaMA directory with a single safetensors file."""
    from safetensors.torch import save_file

    hf = to_hf_tensors(tensors, cfg)
    os.makedirs(path, exist_ok=True)
    save_file(hf, os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
    write_hf_config(path, cfg, next(iter(hf.values())).dtype)
