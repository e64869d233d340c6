"""What ``train_mode: grpo`` adds to a device's memory: the KL's reference policy and the generation cache.

The reference is a frozen copy of the starting weights when ``rl.reference`` resolves to ``copy`` (counted
in the stage totals, like DPO's); the rollouts' key/value cache is allocated while generating, for the rows
one generation call holds (``data.batch_size x optim.grad_accum_steps``) and at most ``data.seq_length``
slots a row (a prompt leaves ``rl.max_new_tokens`` of them), with this rank's share of the kv heads.
"""

from __future__ import annotations

import torch

from megacann.config import MegacannConfig
from megacann.config.rl_keys import reference_kind
from megacann.generation import kv_cache_bytes
from megacann.models.sizing import attention_head_dim
from megacann.planning.formulas import local_kv_rows

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def generation_cache_bytes(cfg: MegacannConfig) -> int:
    """Bytes of the rollouts' key/value cache on one device (its largest allocation)."""
    m, d = cfg.model, cfg.distributed
    head_dim = attention_head_dim(m)
    rows = cfg.data.batch_size * cfg.optim.grad_accum_steps
    heads = local_kv_rows(m, d.tensor_parallel_size) // head_dim
    window = getattr(m, "sliding_window", None)
    return kv_cache_bytes(m.num_layers, rows, cfg.data.seq_length, heads, head_dim, DTYPES[m.precision], window)


def rl_memory_lines(cfg: MegacannConfig, reference_gb: str) -> list[str]:
    """The reference policy's line (``reference_gb``: the copy's GB on its largest stage) and the cache's."""
    kind = reference_kind(cfg)
    reference = {
        "none": "GRPO reference: none (rl.kl_coef 0 or rl.reference none)",
        "copy": f"GRPO reference: a frozen copy of the starting weights, sharded like the policy: {reference_gb} GB "
        "per device (weights only; in the total)",
        "adapters_off": "GRPO reference: the policy's frozen base with the adapters off: no memory of its own",
    }[kind]
    rows = cfg.data.batch_size * cfg.optim.grad_accum_steps
    cache = (
        f"GRPO generation cache: {generation_cache_bytes(cfg) / 1e9:.2f} GB per device ({rows} rows x "
        f"{cfg.data.seq_length} slots, {cfg.model.num_layers} layers, this rank's kv heads, {cfg.model.precision}; "
        "allocated while generating, when no training activation is held: not in the total)"
    )
    return [reference, cache]
