"""Mixture of experts: a top-k router, token dispatch (local or all-to-all across expert-parallel ranks),
SwiGLU experts computed with grouped matmuls, and the MoE layer that joins them. See ``docs/moe.md``."""

from megacann.layers.moe.activation import EXPERT_ACTIVATIONS, ExpertActivation, clamped_swiglu
from megacann.layers.moe.config import SCORE_FUNCTIONS, MoEConfig
from megacann.layers.moe.dispatcher import DispatchState, TokenDispatcher
from megacann.layers.moe.experts import ExpertMLP, GroupedExperts, expert_seed
from megacann.layers.moe.layer import MoELayer, MoEStats, moe_aux_loss, moe_layers, update_expert_biases
from megacann.layers.moe.router import (
    LOAD_BALANCING_TYPES,
    Routing,
    TopKRouter,
    capacity_mask,
    expert_capacity,
    load_balancing_loss,
    sequence_load_balancing_loss,
    z_loss,
)

__all__ = [
    "EXPERT_ACTIVATIONS",
    "ExpertActivation",
    "clamped_swiglu",
    "LOAD_BALANCING_TYPES",
    "SCORE_FUNCTIONS",
    "DispatchState",
    "ExpertMLP",
    "GroupedExperts",
    "MoEConfig",
    "MoELayer",
    "MoEStats",
    "Routing",
    "TokenDispatcher",
    "TopKRouter",
    "capacity_mask",
    "expert_capacity",
    "expert_seed",
    "load_balancing_loss",
    "moe_aux_loss",
    "moe_layers",
    "sequence_load_balancing_loss",
    "update_expert_biases",
    "z_loss",
]
