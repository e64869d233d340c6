"""The key/value cache a recipe's ``generation_eval`` allocates on each rank, as ``--dry_run`` and
``megacann-plan`` print it: :func:`megacann.generation.kv_cache.kv_cache_bytes` for ``batch_size`` rows of
``data.seq_length + max_new_tokens - 1`` slots (prompts longer than ``data.seq_length`` tokens are refused
at run time, so this is what the generator allocates at most), each rank's kv heads (``kv / tp`` when tp
divides them, else the heads its query heads read), per layer's sliding window; Gated DeltaNet layers
(qwen3_5 families) hold a fixed-size state instead (:func:`megacann.generation.recurrent_cache_bytes`)."""

from __future__ import annotations

from typing import Optional

import torch

from megacann.config import MegacannConfig
from megacann.config.generation_eval import generation_cache_slots
from megacann.generation.kv_cache import kv_cache_bytes
from megacann.generation.recurrent_cache import recurrent_cache_bytes
from megacann.layers.attention import kv_heads_for_rank
from megacann.models import get_model_spec
from megacann.models.sizing import attention_head_dim

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rank_kv_heads(cfg: MegacannConfig, tp: int) -> int:
    """The most kv heads one tensor-parallel rank caches."""
    m = cfg.model
    if m.kv_heads % tp == 0:
        return m.kv_heads // tp
    return max(
        end - first for first, end in (kv_heads_for_rank(m.num_attention_heads, m.kv_heads, tp, r) for r in range(tp))
    )


def linear_attention_layers(cfg: MegacannConfig) -> int:
    """How many layers are Gated DeltaNet layers (a family with ``linear_num_value_heads``), not attention."""
    m = cfg.model
    if getattr(m, "linear_num_value_heads", None) is None:
        return 0
    from megacann.models.qwen3_5_config import LINEAR, qwen3_5_layer_types

    return qwen3_5_layer_types(m).count(LINEAR)


def layer_windows(cfg: MegacannConfig) -> list[Optional[int]]:
    """Each attention layer's sliding window (None: full attention)."""
    m = cfg.model
    window = getattr(m, "sliding_window", None)
    if m.type == "gpt_oss":  # sliding and full attention layers
        from megacann.models.gpt_oss_config import gpt_oss_layer_types

        return [window if kind == "sliding_attention" else None for kind in gpt_oss_layer_types(m)]
    return [window] * (m.num_layers - linear_attention_layers(cfg))


def linear_attention_cache_bytes(cfg: MegacannConfig, tp: int) -> int:
    """Bytes of the Gated DeltaNet layers' states and convolution tails on one rank (its heads' share)."""
    m = cfg.model
    layers = linear_attention_layers(cfg)
    if not layers:
        return 0
    value_heads = m.linear_num_value_heads // tp
    channels = 2 * (m.linear_num_key_heads // tp) * m.linear_key_head_dim + value_heads * m.linear_value_head_dim
    sizes = (value_heads, m.linear_key_head_dim, m.linear_value_head_dim, channels, m.linear_conv_kernel_dim)
    return recurrent_cache_bytes(layers, cfg.generation_eval.batch_size, *sizes, DTYPES[m.precision])


def generation_cache_bytes(cfg: MegacannConfig, tp: int) -> int:
    """Bytes of the generation_eval cache on one rank of tensor-parallel size ``tp``."""
    section, m = cfg.generation_eval, cfg.model
    common = (section.batch_size, generation_cache_slots(cfg), rank_kv_heads(cfg, tp), attention_head_dim(m))
    keys_values = sum(kv_cache_bytes(1, *common, DTYPES[m.precision], window) for window in layer_windows(cfg))
    return keys_values + linear_attention_cache_bytes(cfg, tp)


def generation_cache_lines(cfg: MegacannConfig, tp: int) -> list[str]:
    """The report's lines on the generation_eval cache (none when the recipe asks for no generation)."""
    section = cfg.generation_eval
    if not section.interval:
        return []
    if get_model_spec(cfg.model.type).decode is None:
        return [f"generation_eval: model family {cfg.model.type!r} has no decode path: it cannot generate"]
    total, linear = generation_cache_bytes(cfg, tp), linear_attention_layers(cfg)
    states = f", and {linear} Gated DeltaNet layers' states ({linear_attention_cache_bytes(cfg, tp):,} bytes)"
    return [
        f"generation_eval key/value cache per rank: {total:,} bytes ({total / 2**20:.2f} MiB): "
        f"{section.batch_size} rows x {generation_cache_slots(cfg)} slots (seq {cfg.data.seq_length} + "
        f"{section.max_new_tokens} new - 1) x {len(layer_windows(cfg))} layers x {rank_kv_heads(cfg, tp)} kv heads "
        f"(tp {tp}) x head dim {attention_head_dim(cfg.model)}, {cfg.model.precision}, keys and values"
        + (states if linear else "")
    ]
