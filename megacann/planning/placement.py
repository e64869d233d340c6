"""Where a device's static bytes live for every ZeRO stage, hybrid sharding and optimizer offload.

:func:`megacann.planning.formulas.static_bytes` counts stages 0-2 on the device. On top of it:

- ZeRO-3 (``Layout.zero == 3``) shards the weights and gradients too: a device keeps a·Ψ/N of weights and
  4·Ψ/N of gradients, plus the unit being computed gathered whole and the next one prefetched (2 units of
  weights, a = bytes of the weights' dtype) and one unit's whole fp32 gradients until they are
  reduce-scattered; a unit is one transformer layer (the largest of the stage's; the embedding and output
  layer, gathered on their own, are not counted: an underestimate on those stages). Ready for the ZeRO-3
  engine: a recipe reaches it only where ``distributed.zero_optimization`` accepts 3.
- Hybrid sharding (``Layout.zero_group``, from ``distributed.zero_shard_group_size`` where the recipe has
  that key) shards within groups of that many ranks and replicates across them: N is the group size.
- ``optim.offload_optimizer`` moves the optimizer's bytes to host memory: the device keeps none; the host
  keeps an fp32 master (also for fp32 weights: the update runs on host copies), the optimizer state (Adam
  8, SGD 4) and a staging copy of the fp32 gradients the update reads (4), per parameter this rank updates
  (Ψ, or its ZeRO share Ψ/N with padding up to N - 1 elements per bucket).
"""

from __future__ import annotations

from dataclasses import replace

from megacann.config import MegacannConfig
from megacann.planning.formulas import (
    ADAM_STATE_BYTES,
    GRAD_BYTES,
    MASTER_BYTES,
    SGD_STATE_BYTES,
    Layout,
    static_bytes,
    weight_bytes_per_param,
)

ZERO3_UNITS_GATHERED = 2  # the unit computing and the next one prefetched


def host_optimizer_bytes_per_param(cfg: MegacannConfig) -> int:
    """Host bytes per updated parameter with ``optim.offload_optimizer``: master, state, gradient staging."""
    state = SGD_STATE_BYTES if cfg.optim.name == "sgd" else ADAM_STATE_BYTES
    return MASTER_BYTES + state + GRAD_BYTES


def zero_share(layout: Layout, params: float, expert_params: float = 0) -> float:
    """Parameters of ``params`` (``expert_params`` of them experts) one rank owns under ZeRO."""
    return (params - expert_params) / layout.zero_shards + expert_params / layout.expert_zero_shards


def placed_static_bytes(
    cfg: MegacannConfig, layout: Layout, params: int, expert_params: int = 0, unit_params: int = 0
) -> dict[str, float]:
    """{"weights", "grads", "optimizer"} on the device and "host_optimizer" in host memory, at the peak, for
    ``params`` parameters of one device (``expert_params`` of them experts; ``unit_params``: the largest
    transformer layer's, which ZeRO-3 gathers whole)."""
    out: dict[str, float] = dict(static_bytes(cfg, replace(layout, zero=min(layout.zero, 2)), params, expert_params))
    share = zero_share(layout, params, expert_params)
    if layout.zero >= 3:
        out["weights"] = weight_bytes_per_param(cfg) * (share + ZERO3_UNITS_GATHERED * unit_params)
        out["grads"] = GRAD_BYTES * (share + unit_params)
    out["host_optimizer"] = 0.0
    if layout.offload_optimizer:
        out["host_optimizer"] = host_optimizer_bytes_per_param(cfg) * (share if layout.zero else params)
        out["optimizer"] = 0.0
    return out
