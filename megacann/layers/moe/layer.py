"""The mixture-of-experts feed-forward layer: router, token dispatch, routed experts, shared experts.

``MoELayer(config)`` is a drop-in for a dense MLP: ``forward(hidden [b, s, h]) -> [b, s, h]`` (``s`` is
the sequence shard ``s/tp`` under sequence parallelism). After each forward, ``layer.last_stats`` (a
:class:`MoEStats`) holds that forward's auxiliary losses, already weighted by their coefficients (scalars
with grad: add them to the loss) and the per-expert token counts. :func:`moe_aux_loss` sums the losses of
every MoE layer in a model, :func:`update_expert_biases` applies bias-based balancing after an optimizer
step.

Under tensor parallelism the tokens are split across the TP ranks for routing (sequence parallelism
already splits them; otherwise the layer takes its share itself and gathers the output at the end).
With expert tensor parallelism the routed tokens of the whole TP group are then gathered, every rank
computes its slice of every expert, and the partial outputs are reduce-scattered back; without it each
rank dispatches only its own tokens to whole experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.collectives import all_reduce_if_parallel
from megacann.layers import mappings
from megacann.layers.context import with_context_defaults
from megacann.layers.eager_regions import eager_under_compile
from megacann.layers.init import init_normal
from megacann.layers.mlp import SwiGLUMLP
from megacann.layers.moe.config import MoEConfig
from megacann.layers.moe.dispatcher import TokenDispatcher
from megacann.layers.moe.experts import GroupedExperts
from megacann.layers.moe.router import TopKRouter, capacity_mask, expert_capacity
from megacann.layers.random import is_recomputing


@dataclass
class MoEStats:
    """One forward of one MoE layer.

    ``aux_losses``: weighted auxiliary losses by name (``load_balancing`` or, with
    ``load_balancing_type="seq_aux_loss"``, ``seq_load_balancing``, and ``z_loss``; those with a non-zero
    coefficient), scalars with grad. ``tokens_per_expert`` ``[E]``: how many tokens chose each
    expert (before capacity dropping), over the TP group's tokens of this forward. ``dropped_tokens``:
    assignments dropped by capacity (0 when dropless)."""

    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens_per_expert: Optional[torch.Tensor] = None
    dropped_tokens: int = 0

    @property
    def aux_loss(self) -> torch.Tensor:
        """Sum of the weighted auxiliary losses (a zero without grad when there are none)."""
        if not self.aux_losses:
            return torch.zeros(())
        return sum(self.aux_losses.values())


@eager_under_compile  # reads a count on the host: eager under torch.compile
def _drop_over_capacity(scores: torch.Tensor, ids: torch.Tensor, c: MoEConfig) -> tuple[torch.Tensor, int]:
    """``ids`` with the assignments over each expert's capacity set to ``num_experts``, and their number."""
    capacity = expert_capacity(ids.shape[0], c.top_k, c.num_experts, c.capacity_factor)
    keep = capacity_mask(scores, ids, c.num_experts, capacity)
    return ids.masked_fill(~keep, c.num_experts), int((~keep).sum())


def _with_context(config: MoEConfig) -> MoEConfig:
    """``config`` with the settings it leaves None taken from the current layer context."""
    return with_context_defaults(config)


class MoELayer(torch.nn.Module):
    """Parameters: ``router.weight`` (and the buffer ``router.expert_bias``), ``experts.<e>.gate_up_proj
    .weight`` / ``experts.<e>.down_proj.weight`` for this rank's experts (global indices ``e``), and
    ``shared_experts.gate_up_proj.weight`` / ``shared_experts.down_proj.weight`` when there are shared
    experts. ``group`` is the tensor-parallel group, ``expert_group`` the expert-parallel one (defaults
    from :mod:`megacann.parallel_state`)."""

    def __init__(
        self,
        config: MoEConfig,
        group: Optional[dist.ProcessGroup] = None,
        expert_group: Optional[dist.ProcessGroup] = None,
        device: Optional[Union[torch.device, str]] = None,
    ):
        super().__init__()
        self.config = c = _with_context(config)
        self.group = group
        self.tp_size = mappings.tp_world_size(group)
        init, out_init = init_normal(c.init_method_std), init_normal(c.output_layer_init_std)
        self.router = TopKRouter(
            c.hidden_size,
            c.num_experts,
            c.top_k,
            score_function=c.score_function,
            normalize_top_k=c.normalize_top_k,
            routed_scaling_factor=c.routed_scaling_factor,
            aux_loss_coeff=c.aux_loss_coeff,
            z_loss_coeff=c.z_loss_coeff,
            bias_update_rate=c.bias_update_rate,
            num_groups=c.num_groups,
            top_k_groups=c.top_k_groups,
            expert_bias=c.expert_bias,
            load_balancing_type=c.load_balancing_type,
            logit_bias=c.router_bias,
            hash_vocab_size=c.hash_vocab_size,
            init_method=init,
            group=group,
            dtype=c.params_dtype,
            device=device,
        )
        self.shared_experts = None
        if c.shared_ffn_hidden_size > 0:
            self.shared_experts = SwiGLUMLP(
                c.hidden_size,
                c.shared_ffn_hidden_size,
                sequence_parallel=c.sequence_parallel,
                init_method=init,
                output_init_method=out_init,
                group=group,
                dtype=c.params_dtype,
                device=device,
                activation=c.activation if c.activation.kind != "swiglu" else None,  # the routed experts' own
            )
        self.dispatcher = TokenDispatcher(c.num_experts, expert_group)
        ep_rank = dist.get_rank(self.dispatcher.group) if self.dispatcher.ep_size > 1 else 0
        # the same draw on every rank, from torch's CPU RNG (also when building on the meta device)
        layer_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        self.experts = GroupedExperts(
            c.num_experts,
            c.hidden_size,
            c.ffn_hidden_size,
            init,
            out_init,
            layer_seed,
            ep_rank=ep_rank,
            ep_size=self.dispatcher.ep_size,
            tensor_parallel=c.expert_tensor_parallel,
            group=group,
            dtype=c.params_dtype,
            device=device,
            bias=c.expert_linear_bias,
            activation=c.activation,
        )
        self.gather_tokens = self.tp_size > 1 and c.expert_tensor_parallel
        self.last_stats: Optional[MoEStats] = None

    def forward(self, hidden: torch.Tensor, token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``hidden`` ``[b, s, h]`` (a sequence shard under sequence parallelism); ``token_ids`` ``[b, s]`` the
        ids of the same tokens, which hash routing (``hash_vocab_size > 0``) needs."""
        c = self.config
        split_here = self.tp_size > 1 and not c.sequence_parallel
        x = mappings.scatter_to_sequence_parallel_region(hidden, self.group) if split_here else hidden
        if split_here and token_ids is not None:
            token_ids = mappings.scatter_to_sequence_parallel_region(token_ids, self.group)
        b, s, h = x.shape
        routing = self.router(x.reshape(-1, h), num_sequences=b, token_ids=token_ids)  # rows: sequence by sequence
        probs, ids, scores = (t.view(b, s, c.top_k) for t in (routing.probs, routing.expert_ids, routing.scores))
        if self.gather_tokens:  # the TP group's tokens, in sequence order, on every TP rank
            x = mappings.gather_from_sequence_parallel_region(x, self.group)
            probs = mappings.gather_from_sequence_parallel_region(probs, self.group)
            ids = mappings.gather_from_sequence_parallel_region(ids, self.group)
            scores = mappings.gather_from_sequence_parallel_region(scores, self.group)
        tokens, probs, ids = x.reshape(-1, h), probs.reshape(-1, c.top_k), ids.reshape(-1, c.top_k)
        dropped = 0
        if c.capacity_factor is not None:
            ids, dropped = _drop_over_capacity(scores.reshape(-1, c.top_k), ids, c)
        started = self.dispatcher.start_dispatch(tokens, probs, ids)
        # the shared experts run while the tokens' all-to-all (expert parallelism) is in flight
        shared = self.shared_experts(hidden) if self.shared_experts is not None else None
        expert_input, tokens_per_expert, state = self.dispatcher.finish_dispatch(started)
        expert_output = self.experts(expert_input, tokens_per_expert)  # read by nothing but combine
        out = self.dispatcher.combine(expert_output, state, expert_output_unused_after=True).view(x.shape)
        if self.gather_tokens:
            out = mappings.reduce_scatter_to_sequence_parallel_region(out, self.group)
        if split_here:
            out = mappings.gather_from_sequence_parallel_region(out, self.group, tensor_parallel_output_grad=False)
        if shared is not None:
            out = out + shared
        if not is_recomputing():
            self.last_stats = MoEStats(routing.aux_losses, routing.tokens_per_expert, dropped)
        return out

    def update_expert_bias(self, group: Optional[dist.ProcessGroup] = None) -> None:
        """Bias-based balancing step for this layer; see :func:`update_expert_biases`."""
        update_expert_biases([self], group)


def moe_layers(module: torch.nn.Module) -> list[MoELayer]:
    """Every :class:`MoELayer` inside ``module`` (itself included), in module order."""
    return [m for m in module.modules() if isinstance(m, MoELayer)]


def moe_aux_loss(module: torch.nn.Module) -> torch.Tensor:
    """Sum of the weighted auxiliary losses of the last forward of every MoE layer in ``module``."""
    losses = [layer.last_stats.aux_loss for layer in moe_layers(module) if layer.last_stats is not None]
    return sum(losses) if losses else torch.zeros(())


@torch.no_grad()
def update_expert_biases(
    layers: Union[torch.nn.Module, Iterable[MoELayer]], group: Optional[dist.ProcessGroup] = None
) -> None:
    """Apply bias-based balancing to every MoE layer with ``bias_update_rate > 0`` (call after the
    optimizer step): their token counts since the last update are summed over ``group`` (default: the
    data-parallel group with context parallelism, which spans the expert-parallel ranks too) in one
    all-reduce, so every rank moves its biases alike."""
    layers = moe_layers(layers) if isinstance(layers, torch.nn.Module) else list(layers)
    routers = [r for r in (layer.router for layer in layers) if r.expert_bias is not None and r.bias_update_rate > 0]
    if not routers:
        return
    loads = torch.stack([r.load_since_update for r in routers])
    all_reduce_if_parallel(loads, group if group is not None else ps.get_data_parallel_group(True))
    for router, load in zip(routers, loads):
        router.update_expert_bias(load)
