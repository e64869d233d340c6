"""Shape and options of one mixture-of-experts layer."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Optional

import torch

from megacann.layers.moe.activation import ExpertActivation
from megacann.layers.moe.router import LOAD_BALANCING_TYPES
from megacann.layers.moe.router import SCORE_FUNCTIONS as ROUTER_SCORE_FUNCTIONS

SCORE_FUNCTIONS = tuple(ROUTER_SCORE_FUNCTIONS)  # the names MoEConfig.score_function takes


@dataclass
class MoEConfig:
    """One MoE feed-forward layer: ``num_experts`` SwiGLU experts of width ``ffn_hidden_size``, each token
    sent to ``top_k`` of them, plus optional shared experts every token passes through.

    Routing: ``score_function`` turns the router logits into scores (``softmax`` over the experts, as
    Mixtral; ``sigmoid`` per expert, as DeepSeek-V3; ``sqrtsoftplus``, ``sqrt(softplus(logit))`` per expert,
    as DeepSeek-V4); the ``top_k`` highest are chosen and their scores,
    divided by their sum when ``normalize_top_k`` (and ``top_k > 1``: for one expert it would make the
    weight 1 and leave the router without gradient), times ``routed_scaling_factor``, weight the experts'
    outputs. ``hash_vocab_size > 0`` routes by token id instead (DeepSeek-V4's hash-routed layers): a fixed
    table of that many rows gives each token id its ``top_k`` experts, the scores still weight them, and
    the layer's forward needs the tokens' ids (``MoELayer.forward(hidden, token_ids)``).

    Balancing: ``aux_loss_coeff`` weights the switch-transformer load-balancing loss, taken over the
    micro-batch (``load_balancing_type="aux_loss"``) or over each sequence and averaged (``"seq_aux_loss"``,
    DeepSeek-V2/V3's sequence-wise loss), ``z_loss_coeff`` the router z-loss; ``bias_update_rate > 0``
    turns on auxiliary-loss-free balancing (a per-expert bias added to the scores for choosing only, moved
    by this rate after each optimizer step).

    Group-limited routing (DeepSeek-V3): with ``num_groups > 1`` the experts form that many equal groups
    and each token chooses among the experts of its ``top_k_groups`` best groups only (a group rated by
    the sum of its two highest biased scores). ``expert_bias``: keep the per-expert bias buffer even
    without bias-based balancing (a checkpoint's trained bias, DeepSeek-V3's ``e_score_correction_bias``);
    None: only when ``bias_update_rate > 0``.

    Capacity: ``capacity_factor=None`` is dropless; a number caps every expert at
    ``ceil(capacity_factor * tokens * top_k / num_experts)`` tokens per forward (see
    :func:`megacann.layers.moe.router.capacity_mask` for which tokens drop).

    Shared experts: ``num_shared_experts`` experts' worth of one dense SwiGLU MLP, of width
    ``shared_expert_ffn_hidden_size`` (default ``num_shared_experts * ffn_hidden_size``).

    Parallelism: with tensor parallelism, ``expert_tensor_parallel=True`` splits every expert's
    matrices across the TP ranks (each rank computes its slice for all tokens of the TP group);
    ``False`` keeps whole experts on every TP rank, each rank routing only its own share of the tokens.
    ``sequence_parallel`` says the layer's input and output are sequence shards ``[b, s/tp, h]``.

    gpt-oss: ``router_bias`` adds a learned bias to the router logits, ``expert_linear_bias`` biases to
    both projections of every expert, ``activation`` picks the experts' activation (SwiGLU or the clamped
    SwiGLU, :class:`~megacann.layers.moe.activation.ExpertActivation`; the shared experts apply it too, as
    DeepSeek-V4's do).

    ``sequence_parallel``, ``init_method_std``, ``output_layer_init_std`` (the experts' ``down_proj``) and
    ``params_dtype`` left None come from the current :class:`~megacann.layers.context.LayerContext` when
    the layer is built (``layer.config`` holds the values used).
    """

    hidden_size: int
    num_experts: int
    ffn_hidden_size: int
    top_k: int = 2
    score_function: str = "softmax"
    normalize_top_k: bool = True
    routed_scaling_factor: float = 1.0
    aux_loss_coeff: float = 0.0
    load_balancing_type: str = "aux_loss"
    z_loss_coeff: float = 0.0
    bias_update_rate: float = 0.0
    num_groups: int = 1
    top_k_groups: int = 1
    expert_bias: Optional[bool] = None
    capacity_factor: Optional[float] = None
    num_shared_experts: int = 0
    shared_expert_ffn_hidden_size: Optional[int] = None
    expert_tensor_parallel: bool = True
    sequence_parallel: Optional[bool] = None
    init_method_std: Optional[float] = None
    output_layer_init_std: Optional[float] = None
    params_dtype: Optional[torch.dtype] = None
    router_bias: bool = False
    expert_linear_bias: bool = False
    activation: ExpertActivation = field(default_factory=ExpertActivation)
    hash_vocab_size: int = 0

    def __post_init__(self) -> None:
        for key in ("hidden_size", "num_experts", "ffn_hidden_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"MoEConfig.{key} must be >= 1, got {getattr(self, key)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoEConfig.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.score_function not in SCORE_FUNCTIONS:
            close = difflib.get_close_matches(str(self.score_function), SCORE_FUNCTIONS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"MoEConfig.score_function={self.score_function!r} is not one of {SCORE_FUNCTIONS}{hint}")
        if self.load_balancing_type not in LOAD_BALANCING_TYPES:
            close = difflib.get_close_matches(str(self.load_balancing_type), LOAD_BALANCING_TYPES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"MoEConfig.load_balancing_type={self.load_balancing_type!r} is not one of {LOAD_BALANCING_TYPES}{hint}"
            )
        for key in ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
            if getattr(self, key) < 0:
                raise ValueError(f"MoEConfig.{key} must be >= 0, got {getattr(self, key)}")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(
                f"MoEConfig.num_groups {self.num_groups} must be >= 1 and divide num_experts {self.num_experts}"
            )
        if not 1 <= self.top_k_groups <= self.num_groups:
            raise ValueError(
                f"MoEConfig.top_k_groups must be in [1, num_groups={self.num_groups}], got {self.top_k_groups}"
            )
        if self.top_k > self.top_k_groups * (self.num_experts // self.num_groups):
            raise ValueError(
                f"MoEConfig.top_k {self.top_k} exceeds the {self.top_k_groups * (self.num_experts // self.num_groups)} "
                "experts of the top_k_groups groups a token may choose from"
            )
        if self.routed_scaling_factor <= 0:
            raise ValueError(f"MoEConfig.routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(
                f"MoEConfig.capacity_factor must be > 0 (or None for dropless routing), got {self.capacity_factor}"
            )
        if self.hash_vocab_size < 0:
            raise ValueError(f"MoEConfig.hash_vocab_size must be >= 0 (0: learned routing), got {self.hash_vocab_size}")
        if self.hash_vocab_size and (self.bias_update_rate > 0 or self.expert_bias or self.num_groups > 1):
            raise ValueError(
                f"MoEConfig.hash_vocab_size={self.hash_vocab_size}: hash routing fixes each token's experts, so "
                "bias_update_rate, expert_bias and num_groups > 1 must be left off"
            )
        if self.num_shared_experts < 0:
            raise ValueError(f"MoEConfig.num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.shared_expert_ffn_hidden_size is not None and self.shared_expert_ffn_hidden_size < 1:
            raise ValueError(
                f"MoEConfig.shared_expert_ffn_hidden_size must be >= 1, got {self.shared_expert_ffn_hidden_size}"
            )

    @property
    def shared_ffn_hidden_size(self) -> int:
        """Width of the shared-expert MLP (0: none)."""
        if self.shared_expert_ffn_hidden_size is not None:
            return self.shared_expert_ffn_hidden_size
        return self.num_shared_experts * self.ffn_hidden_size
