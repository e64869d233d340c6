"""The top-k router: scores, expert choice, auxiliary losses, capacity and bias-based balancing.

For tokens ``x [T, h]`` the router computes logits ``x Wᵀ`` (in fp32 at least), scores (``SCORE_FUNCTIONS``:
softmax over the experts, a sigmoid per expert, or DeepSeek-V4's ``sqrt(softplus(logit))`` per expert), picks the ``top_k`` experts with the highest ``score + expert_bias`` (the bias,
zero unless bias-based balancing is on or a checkpoint brought one, only steers the choice) and weights
them with their scores, optionally normalised to sum to one and scaled.

Group-limited routing (DeepSeek-V3, ``num_groups > 1``): the experts form ``num_groups`` equal groups, each
group is rated by the sum of its two highest biased scores, and a token picks its ``top_k`` experts only
among the ``top_k_groups`` best groups (transformers' DeepseekV3TopkRouter).

Auxiliary losses, already multiplied by their coefficients, over the ``N`` tokens of the tensor-parallel
group (every TP rank routes its own share of them):

- load balancing (Switch Transformer): ``coeff · E · Σ_e f_e · P_e`` with ``f_e`` the fraction of the
  ``N · top_k`` assignments that went to expert ``e`` and ``P_e`` the mean over tokens of the scores
  normalised to sum to one per token. Perfect balance gives ``coeff``;
- sequence-wise load balancing (DeepSeek-V2/V3; ``load_balancing_type="seq_aux_loss"``, in place of the
  one above): the same loss taken over each sequence of the micro-batch alone (``f_e`` and ``P_e`` over
  its ``T`` tokens) and averaged over the ``b`` sequences. The tokens come flattened from ``[b, s]``
  (sequence-major), so ``forward(x, num_sequences=b)`` says how to split them; with one sequence it is
  the loss above;
- z-loss (ST-MoE): ``coeff · mean_t logsumexp(logits_t)²``.

Under tensor parallelism each rank computes its tokens' share of a loss and the shares are summed in
forward only, so every rank holds the whole value and backward reaches each token once; the router
weight's gradient is then partial per rank (marked ``tp_partial_grad``). Under context parallelism the
losses are taken over the whole sequence too, as in one process: the token counts are summed over the
context-parallel group and so are the loss shares, in forward and in backward (every cp rank's objective
holds the whole value and gradients are summed over the cp ranks, so each share's gradient is the sum of
theirs). The sequence-wise loss does the same per sequence: every rank holds a share of each of the ``b``
sequences, and the ``[b, E]`` counts are summed over both groups.

Hash routing (DeepSeek-V4's first MoE layers; ``hash_vocab_size > 0``): the experts of a token are fixed by
its id, row ``token_id`` of the ``[hash_vocab_size, top_k]`` table ``token_to_experts`` (a persistent buffer,
transformers' ``tid2eid``; until a checkpoint brings its table, token ``t`` goes to experts ``(t·k + j) mod
E``). ``forward`` then needs the tokens' ids; the scores still weight the chosen experts (and give the
router its gradient), and the balancing losses count the table's choices.

``choice_hook`` (None by default) sees each forward's chosen expert ids and may replace them: the gate
weights are then the router's own scores of the experts it returns (router replay, :mod:`.routing_replay`).

Bias-based balancing (DeepSeek-V3): in training the router adds up how many tokens each expert was
chosen for; :meth:`TopKRouter.update_expert_bias` (after the optimizer step) moves each bias by
``bias_update_rate`` towards balance: ``bias_e += rate · sign(mean load − load_e)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

from megacann import parallel_state as ps
from megacann.layers import mappings
from megacann.layers.init import default_init_methods, init_zeros, make_parameter, resolve_device
from megacann.layers.random import is_recomputing
from megacann.layers.sharding import InitMethod

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss")  # Megatron-Core's moe_router_load_balancing_type names


def sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's per-expert score ``sqrt(softplus(logit))``: positive, growing like ``sqrt(logit)``."""
    return F.softplus(logits).sqrt()


# the score of each expert from the router logits [T, E]; every one but softmax scores experts independently
SCORE_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": sqrt_softplus,
}


@dataclass
class Routing:
    """The router's decision for ``T`` tokens.

    ``probs`` ``[T, k]`` weights of the chosen experts (fp32 or wider, with grad); ``expert_ids`` ``[T, k]``
    (int64); ``scores`` ``[T, k]`` the chosen experts' raw scores (no grad; capacity priority);
    ``tokens_per_expert`` ``[E]`` assignments per expert over the TP group's tokens; ``aux_losses``
    weighted auxiliary losses by name (only those with a non-zero coefficient)."""

    probs: torch.Tensor
    expert_ids: torch.Tensor
    scores: torch.Tensor
    tokens_per_expert: torch.Tensor
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)


def load_balancing_loss(
    scores: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: int, top_k: int, coeff: float
) -> torch.Tensor:
    """Switch-transformer loss of the tokens whose normalised scores are ``scores`` ``[T, E]``, with
    ``tokens_per_expert`` and ``num_tokens`` counted over all tokens the loss is about (``T`` may be a
    share of them; the shares' losses add up to the whole)."""
    num_experts = scores.shape[-1]
    fraction = tokens_per_expert.to(scores.dtype) / (num_tokens * top_k)
    mean_score = scores.sum(0) / num_tokens
    return coeff * num_experts * (fraction * mean_score).sum()


def sequence_load_balancing_loss(
    scores: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: int, top_k: int, coeff: float
) -> torch.Tensor:
    """DeepSeek's sequence-wise loss: :func:`load_balancing_loss` of each sequence, averaged over them.
    ``scores`` ``[b, T, E]`` normalised scores (``T`` may be a share of each sequence), ``tokens_per_expert``
    ``[b, E]`` and ``num_tokens`` counted over each whole sequence."""
    num_experts = scores.shape[-1]
    fraction = tokens_per_expert.to(scores.dtype) / (num_tokens * top_k)
    mean_score = scores.sum(1) / num_tokens
    return coeff * num_experts * (fraction * mean_score).sum(-1).mean()


def z_loss(logits: torch.Tensor, num_tokens: int, coeff: float) -> torch.Tensor:
    """``coeff · Σ_t logsumexp(logits_t)² / num_tokens`` over the rows of ``logits``."""
    return coeff * torch.logsumexp(logits, dim=-1).square().sum() / num_tokens


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Most tokens one expert takes in a forward: ``ceil(capacity_factor · tokens · top_k / experts)``."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def capacity_mask(scores: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which assignments ``[T, k]`` an expert of ``capacity`` keeps: within each expert, the ``capacity``
    assignments with the highest router score; among equal scores the earlier token (then the earlier
    of its top-k slots) wins. The rest are dropped: that expert does not see the token, whose output
    lacks that expert's share (it still gets its other experts and the shared experts)."""
    flat_ids, flat_scores = expert_ids.reshape(-1), scores.reshape(-1)
    by_score = torch.argsort(-flat_scores, stable=True)  # ties keep token order
    order = by_score[torch.argsort(flat_ids[by_score], stable=True)]  # grouped by expert, best first
    counts = torch.bincount(flat_ids, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.empty_like(flat_ids)
    rank_in_expert[order] = torch.arange(order.numel(), device=order.device) - starts[flat_ids[order]]
    return (rank_in_expert < capacity).view_as(expert_ids)


class TopKRouter(torch.nn.Module):
    """``forward(x [T, h]) -> Routing``. ``weight`` ``[num_experts, hidden_size]`` is whole on every rank;
    ``expert_bias`` (fp32) steers the choice: a persistent buffer when ``bias_update_rate > 0`` and
    ``expert_bias`` is None, a frozen parameter (``requires_grad=False``: moved only by the balancing
    update, never by the optimizer) when ``expert_bias=True`` (a checkpoint's trained bias, DeepSeek-V3).

    ``group`` is the tensor-parallel group over which the tokens of one sequence are split (each rank
    routes its share); the token counts and auxiliary losses are summed over it. ``context_group`` (default:
    the context-parallel group of :mod:`megacann.parallel_state`) holds the other parts of each sequence:
    the auxiliary losses are taken over the whole sequence across it. ``Routing.tokens_per_expert`` stays
    the count of this tensor-parallel group's tokens. ``load_balancing_type`` (one of
    ``LOAD_BALANCING_TYPES``) says which balancing loss ``aux_loss_coeff`` weights: the micro-batch's
    (``aux_loss``) or each sequence's (``seq_aux_loss``). ``logit_bias`` adds the learned parameter ``bias``
    to the logits (gpt-oss). ``hash_vocab_size > 0`` routes by token id (see the module's docstring)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        score_function: str = "softmax",
        normalize_top_k: bool = True,
        routed_scaling_factor: float = 1.0,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        bias_update_rate: float = 0.0,
        num_groups: int = 1,
        top_k_groups: int = 1,
        expert_bias: Optional[bool] = None,
        init_method: Optional[InitMethod] = None,
        group: Optional[dist.ProcessGroup] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str]] = None,
        context_group: Optional[dist.ProcessGroup] = None,
        load_balancing_type: str = "aux_loss",
        logit_bias: bool = False,
        hash_vocab_size: int = 0,
    ):
        super().__init__()
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"TopKRouter: score_function {score_function!r} is not one of {tuple(SCORE_FUNCTIONS)}")
        if load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ValueError(
                f"TopKRouter: load_balancing_type {load_balancing_type!r} is not one of {LOAD_BALANCING_TYPES}"
            )
        self.load_balancing_type = load_balancing_type
        if context_group is None and ps.model_parallel_is_initialized():
            context_group = ps.get_context_parallel_group()
        self.context_group = context_group
        self.cp_size = dist.get_world_size(context_group) if context_group is not None else 1
        self.num_experts, self.top_k = num_experts, top_k
        self.score_function = score_function
        self.normalize_top_k = normalize_top_k
        self.routed_scaling_factor = routed_scaling_factor
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.bias_update_rate = bias_update_rate
        self.num_groups, self.top_k_groups = num_groups, top_k_groups
        if num_experts % num_groups or not 1 <= top_k_groups <= num_groups:
            raise ValueError(
                f"TopKRouter: num_groups {num_groups} must divide num_experts {num_experts} and top_k_groups "
                f"{top_k_groups} be in [1, num_groups]"
            )
        if top_k > top_k_groups * (num_experts // num_groups):
            raise ValueError(
                f"TopKRouter: top_k {top_k} exceeds the experts of top_k_groups {top_k_groups} groups of "
                f"{num_experts // num_groups}"
            )
        self.group = group
        self.tp_size = mappings.tp_world_size(group)
        self._check_hash_routing(hash_vocab_size, bias_update_rate, expert_bias)
        self.weight = make_parameter(
            (num_experts, hidden_size),
            init_method or default_init_methods()[0],
            tp_rank=0,
            tp_size=1,
            tp_partial_grad=self.tp_size > 1,
            name="TopKRouter weight",
            dtype=dtype,
            device=device,
        )
        self.bias = None
        if logit_bias:  # a learned bias of the logits (gpt-oss), unlike expert_bias, which only steers the choice
            self.bias = make_parameter(
                (num_experts,), init_zeros(), tp_rank=0, tp_size=1, tp_partial_grad=self.tp_size > 1,
                name="TopKRouter bias", dtype=dtype, device=device,
            )  # fmt: skip
        device = resolve_device(device)  # the parameter's (from the layer context when None)
        with_bias = bias_update_rate > 0 if expert_bias is None else expert_bias
        if bias_update_rate > 0 and not with_bias:
            raise ValueError("TopKRouter: bias_update_rate > 0 needs the expert bias (expert_bias=False given)")
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device) if with_bias else None
        if expert_bias:  # a frozen parameter, so weight conversion (Hugging Face both ways) carries it
            bias = make_parameter(
                (num_experts,),
                init_zeros(),
                tp_rank=0,
                tp_size=1,
                name="TopKRouter expert_bias",
                dtype=torch.float32,
                device=device,
            )
            self.expert_bias = bias.requires_grad_(False)
        else:
            self.register_buffer("expert_bias", bias)
        load = None if bias is None else torch.zeros(num_experts, dtype=torch.int64, device=device)  # exact counts
        self.register_buffer("load_since_update", load, persistent=False)
        table = None
        if hash_vocab_size:  # a spread over the experts until a checkpoint brings the trained table
            slots = torch.arange(hash_vocab_size * top_k, device=device).view(hash_vocab_size, top_k)
            table = slots % num_experts
        self.register_buffer("token_to_experts", table)
        # (router, chosen ids [T, k]) -> the ids used: sees or overrides each forward's choice (None: off)
        self.choice_hook: Optional[Callable[[TopKRouter, torch.Tensor], torch.Tensor]] = None

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, score_function={self.score_function}, "
            f"normalize_top_k={self.normalize_top_k}, load_balancing_type={self.load_balancing_type}, "
            f"bias_update_rate={self.bias_update_rate}, "
            f"num_groups={self.num_groups}, top_k_groups={self.top_k_groups}"
            + (f", hash_vocab_size={self.token_to_experts.shape[0]}" if self.token_to_experts is not None else "")
        )

    def _check_hash_routing(self, hash_vocab_size: int, bias_update_rate: float, expert_bias: Optional[bool]) -> None:
        """Refuse what hash routing leaves without meaning: a choice steered by biases or limited to groups."""
        if hash_vocab_size < 0:
            raise ValueError(f"TopKRouter: hash_vocab_size must be >= 0 (0: learned routing), got {hash_vocab_size}")
        if hash_vocab_size and (bias_update_rate > 0 or expert_bias or self.num_groups > 1):
            raise ValueError(
                "TopKRouter: hash routing (hash_vocab_size > 0) fixes each token's experts; it takes no expert bias, "
                f"bias_update_rate or num_groups > 1 (got expert_bias={expert_bias}, bias_update_rate="
                f"{bias_update_rate}, num_groups={self.num_groups})"
            )

    def limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` ``[T, E]`` with the experts outside each token's ``top_k_groups`` best groups set to
        -inf; a group's rating is the sum of its two highest entries (its one entry when it has one)."""
        tokens, per_group = choice.shape[0], self.num_experts // self.num_groups
        grouped = choice.view(tokens, self.num_groups, per_group)
        rating = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)
        best = torch.topk(rating, self.top_k_groups, dim=-1).indices
        keep = torch.zeros_like(rating, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, self.num_experts)

    def forward(self, x: torch.Tensor, num_sequences: int = 1, token_ids: Optional[torch.Tensor] = None) -> Routing:
        """Route the tokens ``x`` ``[T, h]``: ``num_sequences`` sequences of ``T / num_sequences`` tokens
        each, one after the other (what the sequence-wise loss balances). ``token_ids`` (``T`` ids, any
        shape): the tokens' ids, which hash routing needs and other routing ignores."""
        if num_sequences < 1 or x.shape[0] % num_sequences:
            raise ValueError(f"TopKRouter: {x.shape[0]} tokens do not split into num_sequences={num_sequences}")
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 at least
        logits = F.linear(x.to(dtype), self.weight.to(dtype), None if self.bias is None else self.bias.to(dtype))
        scores = SCORE_FUNCTIONS[self.score_function](logits)
        if self.token_to_experts is not None:
            expert_ids = self._hashed_choice(token_ids, x.shape[0])
        else:
            choice = scores.detach() if self.expert_bias is None else scores.detach() + self.expert_bias
            if self.num_groups > 1:
                choice = self.limit_to_groups(choice)
            expert_ids = torch.topk(choice, self.top_k, dim=-1).indices
        if self.choice_hook is not None:  # record or replace the choice (megacann.layers.moe.routing_replay)
            expert_ids = self.choice_hook(self, expert_ids)
        probs = scores.gather(1, expert_ids)
        if self.normalize_top_k and self.top_k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            probs = probs * self.routed_scaling_factor
        per_sequence = self.aux_loss_coeff > 0 and self.load_balancing_type == "seq_aux_loss"
        # [b, E] per sequence for the sequence-wise loss (one all-reduce over TP either way), else [E]
        counts = self._count_choices(expert_ids, num_sequences if per_sequence else None)
        tokens_per_expert = counts.sum(0) if per_sequence else counts
        if self.expert_bias is not None and self.training and not is_recomputing():
            self.load_since_update += tokens_per_expert
        routing = Routing(probs, expert_ids, scores.detach().gather(1, expert_ids), tokens_per_expert)
        num_tokens = x.shape[0] * self.tp_size * self.cp_size  # the whole micro-batch's
        if self.aux_loss_coeff > 0:
            if self.cp_size > 1:  # counted over the other parts of the sequences too
                counts = counts.clone()
                dist.all_reduce(counts, group=self.context_group)
            normalised = scores if self.score_function == "softmax" else scores / scores.sum(-1, keepdim=True)
            if per_sequence:
                by_sequence = normalised.view(num_sequences, -1, self.num_experts)
                loss = sequence_load_balancing_loss(
                    by_sequence, counts, num_tokens // num_sequences, self.top_k, self.aux_loss_coeff
                )
                routing.aux_losses["seq_load_balancing"] = self._sum_over_sequence(loss)
            else:
                loss = load_balancing_loss(normalised, counts, num_tokens, self.top_k, self.aux_loss_coeff)
                routing.aux_losses["load_balancing"] = self._sum_over_sequence(loss)
        if self.z_loss_coeff > 0:
            routing.aux_losses["z_loss"] = self._sum_over_sequence(z_loss(logits, num_tokens, self.z_loss_coeff))
        return routing

    def _hashed_choice(self, token_ids: Optional[torch.Tensor], num_tokens: int) -> torch.Tensor:
        """The experts ``[T, k]`` the table fixes for the tokens ``token_ids``."""
        if token_ids is None or token_ids.numel() != num_tokens:
            got = "none" if token_ids is None else f"{token_ids.numel()}"
            raise ValueError(f"TopKRouter: hash routing needs the ids of the {num_tokens} tokens it routes, got {got}")
        return self.token_to_experts[token_ids.reshape(-1).long()]

    def _count_choices(self, expert_ids: torch.Tensor, num_sequences: Optional[int]) -> torch.Tensor:
        """Assignments per expert over the TP group's tokens: ``[E]``, or ``[num_sequences, E]`` per sequence
        (the rows of ``expert_ids`` sequence after sequence)."""
        if num_sequences is None:
            counts = torch.bincount(expert_ids.reshape(-1), minlength=self.num_experts)
        else:
            ids = expert_ids.reshape(num_sequences, -1)
            counts = torch.zeros(num_sequences, self.num_experts, dtype=torch.int64, device=ids.device)
            counts.scatter_add_(1, ids, torch.ones_like(ids))
        if self.tp_size > 1:
            dist.all_reduce(counts, group=mappings.tp_group(self.group))
        return counts

    def _sum_over_sequence(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' shares of a loss: over the TP group in forward only (backward passes the gradient
        through unchanged), then over the cp group in forward and backward."""
        if self.tp_size > 1:
            loss = mappings.reduce_from_tensor_model_parallel_region(loss, self.group)
        if self.cp_size > 1:
            loss = dist_nn.all_reduce(loss, group=self.context_group)
        return loss

    @torch.no_grad()
    def update_expert_bias(self, load: Optional[torch.Tensor] = None) -> None:
        """Move the bias by ``bias_update_rate`` towards balance, from ``load`` (default: the load this
        router counted since the last update, which is then reset). For the same bias on every rank the
        load must be the same everywhere: :func:`megacann.layers.moe.update_expert_biases` sums it over the
        data-parallel group first."""
        if self.expert_bias is None or self.bias_update_rate == 0:
            raise RuntimeError("TopKRouter.update_expert_bias: bias-based balancing is off (bias_update_rate 0)")
        load = (self.load_since_update if load is None else load).double()
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load).to(self.expert_bias)
        self.load_since_update.zero_()
