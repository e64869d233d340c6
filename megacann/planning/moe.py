"""Memory formulas of a mixture-of-experts layer (the family's :class:`~megacann.models.spec.MoEStructure`).

**Parameters** of one MoE layer on one rank (t = TP size, ep = expert-parallel size, h hidden, E routed
experts of width f_e, shared-expert width f_s): attention and norms as a dense layer, plus

- the router: E x h (+ E with a router bias, gpt-oss), whole on every rank (dense: data-parallel);
- the shared experts: one SwiGLU MLP of width f_s, split over TP like a dense MLP: 3 h f_s / t (dense);
- the routed experts: E / ep experts on each expert-parallel rank, each split over TP like a dense MLP:
  (E / ep) x 3 h f_e / t (expert parameters); with expert biases (gpt-oss) each expert also has
  2 f_e / t (gate|up, split) + h (down, whole on every TP rank).

Expert parallelism is carved out of data parallelism (ep divides dp): dense parameters are replicated
over the dp (x cp) ranks, expert parameters only over the dp / ep (x cp) ranks of the expert-data-parallel
group that hold the same experts. Gradients are reduced, and ZeRO shards master weights, optimizer state
(and ZeRO-2 gradients) over those groups: dense parameters over dp x cp ranks, expert parameters over
dp / ep x cp ranks (:mod:`megacann.optimizer.grad_buffer`, one buffer per kind).

**Activations** of one MoE layer and micro-batch (T tokens on the rank, a = bytes of the weights'
dtype, k = top_k): the router runs on T_r = T / t tokens (each TP rank routes its share of the
sequence), the experts on the TP group's T tokens (every TP rank computes its slice of every expert, the
expert input gathered over TP). With balanced routing an expert-parallel rank receives as many token
copies as it sends, so its experts compute R = T k rows (with a capacity factor c, at most
E x ceil(c T k / E)). Saved for backward, per token or row:

- router: its input in fp32 (4h per routed token; in fp32 training the norm's output itself), the
  scores (4E; DeepSeek-V4's ``sqrtsoftplus`` also its logits, 4E more), the chosen experts' ids (8k) and weights (4k), with ``normalize_top_k`` their
  unnormalised copy and sum (4k + 4), and the weights in the tokens' dtype where that is not fp32 (ak);
- routed experts, per row they compute: the input (ah), the gate|up output (2a f_e / t), silu(gate) and
  the down projection's input (a f_e / t each; the clamped SwiGLU of gpt-oss saves three f_e-wide tensors
  more: the clamped gate and up, and the gate's sigmoid); per token copy the rank sends (T k, dropped ones too): the
  int64 source index of the permutation (8), the int32 row map (4) and the expert output the weighted
  sum gathers (ah);
- shared experts: as a dense SwiGLU MLP (4a f_s / t per token; clamped, as DeepSeek-V4's: 7a f_s / t), and the MLP input once more (ah) where it
  is not the router's own input (low-precision weights, or TP); a gated shared expert (Qwen3.5-MoE) also
  its output and the gate's sigmoid (a (h + 1)), and holds the gate row (h parameters, dense).

Not counted: the z-loss's logits and log-sum-exp (``moe_z_loss_coeff``), the fp32 copy of a low-precision
router weight, and load imbalance (an expert-parallel rank receiving more than its share of rows). The
layer terms are measured against a tiny fp32 run in tests/test_planner_moe.py.
"""

from __future__ import annotations

import math

from megacann.models.spec import MoEStructure


def moe_parameters_per_rank(h: int, tp: int, ep: int, moe: MoEStructure) -> tuple[int, int]:
    """(dense, expert) parameters of one MoE layer's feed-forward block on one rank: the router and shared
    experts (dense), this expert-parallel rank's routed experts (expert)."""
    dense = moe.num_experts * h + 3 * h * moe.shared_ffn_hidden_size // tp + (h if moe.shared_expert_gate else 0)
    dense += moe.num_experts if moe.router_bias else 0
    per_expert = 3 * h * moe.expert_ffn_hidden_size // tp
    per_expert += 2 * moe.expert_ffn_hidden_size // tp + h if moe.expert_bias else 0  # gate|up split, down whole
    experts = moe.num_experts // ep * per_expert
    return dense, experts


def routed_rows(tokens: float, moe: MoEStructure) -> float:
    """Token copies one rank's experts compute per micro-batch, routing balanced: T k, or with a capacity
    factor at most E x ceil(c T k / E) (``tokens``: the TP group's T)."""
    rows = tokens * moe.top_k
    if moe.capacity_factor is None:
        return rows
    return min(rows, moe.num_experts * math.ceil(moe.capacity_factor * rows / moe.num_experts))


def moe_activation_terms(tokens: float, a: int, h: int, tp: int, moe: MoEStructure) -> dict[str, float]:
    """Bytes an MoE feed-forward block saves for one micro-batch of ``tokens`` tokens on the rank, by what
    saves them (see the module docstring); the layer's norms and attention are a dense layer's."""
    k, routed = moe.top_k, tokens / tp
    scores = (8 if moe.score_function == "sqrtsoftplus" else 4) * moe.num_experts  # sqrt(softplus): its logits too
    router = 4 * h + scores + 12 * k + (4 * k + 4 if moe.normalize_top_k and k > 1 else 0)
    terms = {"router": routed * router + (tokens * a * k if a != 4 else 0)}
    rows = routed_rows(tokens, moe)
    f = moe.expert_ffn_hidden_size // tp
    activation = 7 if moe.clamped_activation else 4  # f-wide tensors a row: gate|up (2) and what it makes
    terms["routed experts"] = rows * a * (h + activation * f) + tokens * k * (a * h + 12)
    if moe.shared_ffn_hidden_size:
        again = h if a != 4 or tp > 1 else 0
        gate = routed * a * (h + 1) if moe.shared_expert_gate else 0  # on the router's tokens
        width = activation * moe.shared_ffn_hidden_size // tp
        terms["shared experts"] = tokens * a * (width + again) + gate
    return terms
