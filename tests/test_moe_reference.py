"""An independent mixture-of-experts reference: a plain-PyTorch MoE feed-forward layer written here from
the formulas (router logits, softmax or sigmoid scores, a choice-only bias, top-k, renormalised and scaled
weights, the documented capacity rule, SwiGLU routed and shared experts, the switch load-balancing loss and
the z-loss), with nothing taken from megacann. megacann's ``MoELayer`` gets the reference's weights by
parameter name and must give its outputs, auxiliary losses and input / weight gradients (fp32, 1e-5
relative), in one process (ep 1) and with the experts split over 2 gloo ranks (ep 2). Qwen3-MoE and
DeepSeek-V3 routing are also checked against the blocks of ``transformers``, where they exist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_on_ranks

TOL = 1e-5
HIDDEN, FFN, EXPERTS, BATCH, SEQ = 16, 8, 4, 2, 8
CHOICE_BIAS = (0.3, -0.25, 0.0, 0.15)  # large against sigmoid scores: it changes choices (checked)


# -- the reference ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """The options the reference reads (its own names, mapped to megacann's config in ``_megacann_config``)."""

    top_k: int = 2
    score: str = "softmax"  # or "sigmoid"
    normalize: bool = True
    scaling: float = 1.0
    choice_bias: bool = False  # add CHOICE_BIAS to the scores when choosing (not when weighting)
    capacity_factor: Optional[float] = None
    shared_ffn: int = 0
    aux_coeff: float = 0.0
    z_coeff: float = 0.0


def reference_weights(spec: Spec, seed: int) -> dict[str, torch.Tensor]:
    """Router ``[E, h]``, stacked experts ``gate_up [E, 2f, h]`` (gate rows first) and ``down [E, h, f]``,
    and the shared MLP's ``shared_gate_up [2fs, h]`` / ``shared_down [h, fs]``."""
    g = torch.Generator().manual_seed(seed)
    w = {
        "router": torch.randn(EXPERTS, HIDDEN, generator=g) * 0.5,
        "gate_up": torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=g) * 0.3,
        "down": torch.randn(EXPERTS, HIDDEN, FFN, generator=g) * 0.3,
    }
    if spec.shared_ffn:
        w["shared_gate_up"] = torch.randn(2 * spec.shared_ffn, HIDDEN, generator=g) * 0.3
        w["shared_down"] = torch.randn(HIDDEN, spec.shared_ffn, generator=g) * 0.3
    return w


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ gate_up.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.t()


def capacity_keep(chosen: torch.Tensor, priority: torch.Tensor, capacity: int) -> torch.Tensor:
    """The documented rule, by enumeration: each expert keeps the ``capacity`` assignments ``(t, j)`` with
    the highest router score, equal scores going to the earlier token, then the earlier slot."""
    keep = torch.zeros_like(chosen, dtype=torch.bool)
    for e in chosen.unique().tolist():  # every expert chosen at least once
        assigned = [(t, j) for t in range(chosen.shape[0]) for j in range(chosen.shape[1]) if chosen[t, j] == e]
        assigned.sort(key=lambda tj: (-float(priority[tj]), tj[0], tj[1]))
        for t, j in assigned[:capacity]:
            keep[t, j] = True
    return keep


def reference_moe(x: torch.Tensor, w: dict[str, torch.Tensor], spec: Spec) -> tuple[torch.Tensor, dict, dict]:
    """``(out [b, s, h], weighted aux losses by name, facts)`` for the tokens of ``x`` (the number of experts
    and the sizes are the weights')."""
    experts, hidden = w["router"].shape
    tokens = x.reshape(-1, hidden)
    n = tokens.shape[0]
    logits = tokens @ w["router"].t()
    scores = torch.softmax(logits, -1) if spec.score == "softmax" else torch.sigmoid(logits)
    choice = scores.detach() + (torch.tensor(CHOICE_BIAS) if spec.choice_bias else 0.0)
    chosen = torch.topk(choice, spec.top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, chosen)
    if spec.normalize and spec.top_k > 1:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * spec.scaling
    keep = torch.ones_like(chosen, dtype=torch.bool)
    if spec.capacity_factor is not None:
        capacity = math.ceil(spec.capacity_factor * n * spec.top_k / experts)
        keep = capacity_keep(chosen, scores.detach().gather(1, chosen), capacity)
    out = torch.zeros_like(tokens)
    for e in range(experts):
        rows, slots = torch.nonzero((chosen == e) & keep, as_tuple=True)
        if rows.numel():
            y = swiglu_mlp(tokens[rows], w["gate_up"][e], w["down"][e]) * weights[rows, slots, None]
            out = out.index_add(0, rows, y)
    if "shared_gate_up" in w:
        out = out + swiglu_mlp(tokens, w["shared_gate_up"], w["shared_down"])
    aux = {}
    counts = torch.stack([(chosen == e).sum() for e in range(experts)])  # before any dropping
    if spec.aux_coeff:
        fraction = counts.float() / (n * spec.top_k)
        probs = scores / scores.sum(-1, keepdim=True)  # softmax: unchanged; sigmoid: per token to sum one
        aux["load_balancing"] = spec.aux_coeff * experts * (fraction * probs.mean(0)).sum()
    if spec.z_coeff:
        aux["z_loss"] = spec.z_coeff * torch.logsumexp(logits, -1).square().mean()
    facts = {"dropped": int((~keep).sum()), "counts": counts, "chosen": chosen}
    if spec.choice_bias:
        facts["bias_changed_choice"] = bool((torch.topk(scores.detach(), spec.top_k).indices != chosen).any())
    return out.view_as(x), aux, facts


def reference_run(spec: Spec, w: dict, x: torch.Tensor, g: torch.Tensor) -> dict:
    """Forward and backward of ``(out * g).sum() + aux`` through the reference."""
    leaves = {k: v.clone().requires_grad_() for k, v in w.items()}
    x = x.clone().requires_grad_()
    out, aux, facts = reference_moe(x, leaves, spec)
    ((out * g).sum() + sum(aux.values(), torch.zeros(()))).backward()
    grads = {k: v.grad for k, v in leaves.items()}
    return {"out": out.detach(), "aux": {k: v.detach() for k, v in aux.items()}, "dx": x.grad, "grads": grads, **facts}


# -- megacann's layer with the reference's weights ------------------------------------------------------


def by_megacann_name(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference's tensors under megacann's parameter names."""
    named = {"router.weight": w["router"]}
    for e in range(w["router"].shape[0]):
        named[f"experts.{e}.gate_up_proj.weight"] = w["gate_up"][e]
        named[f"experts.{e}.down_proj.weight"] = w["down"][e]
    if "shared_gate_up" in w:
        named["shared_experts.gate_up_proj.weight"] = w["shared_gate_up"]
        named["shared_experts.down_proj.weight"] = w["shared_down"]
    return named


def _megacann_config(spec: Spec):
    from megacann.layers import MoEConfig

    return MoEConfig(
        hidden_size=HIDDEN,
        num_experts=EXPERTS,
        ffn_hidden_size=FFN,
        top_k=spec.top_k,
        score_function=spec.score,
        normalize_top_k=spec.normalize,
        routed_scaling_factor=spec.scaling,
        aux_loss_coeff=spec.aux_coeff,
        z_loss_coeff=spec.z_coeff,
        bias_update_rate=0.01 if spec.choice_bias else 0.0,  # the bias buffer exists only then
        capacity_factor=spec.capacity_factor,
        num_shared_experts=1 if spec.shared_ffn else 0,
        shared_expert_ffn_hidden_size=spec.shared_ffn or None,
    )


def megacann_layer(spec: Spec, w: dict[str, torch.Tensor]):
    from megacann.layers import MoELayer

    layer = MoELayer(_megacann_config(spec)).train()
    named = by_megacann_name(w)
    with torch.no_grad():
        for name, p in layer.named_parameters():  # this rank's experts only, under ep
            p.copy_(named[name])
        if spec.choice_bias:
            layer.router.expert_bias.copy_(torch.tensor(CHOICE_BIAS))
    return layer


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return (actual - expected).norm().item() / max(expected.norm().item(), 1e-30)


def _batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + index)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(BATCH, SEQ, HIDDEN, generator=g)


CASES = {
    "softmax_top2": Spec(aux_coeff=0.01, z_coeff=0.001),
    "sigmoid_bias_top2_scaled": Spec(score="sigmoid", choice_bias=True, scaling=2.5, aux_coeff=0.01, z_coeff=0.001),
    "capacity_drops": Spec(capacity_factor=1.0, aux_coeff=0.01),
    "sigmoid_bias_capacity": Spec(score="sigmoid", choice_bias=True, scaling=2.5, capacity_factor=1.0),
    "shared_experts": Spec(shared_ffn=12, aux_coeff=0.01),
    "shared_experts_top1": Spec(top_k=1, shared_ffn=8, z_coeff=0.001),  # top-1: the weight is the raw score
}
SEEDS = {name: 40 + i for i, name in enumerate(CASES)}


def compare(name: str) -> dict[str, float]:
    """This rank's errors of megacann against the reference for case ``name`` (every value must be <= TOL).
    With expert parallelism rank ``r`` runs batch ``r``; expert gradients are compared on the rank holding
    the expert, with the reference's summed over every rank's batch, and the replicated (router, shared)
    gradients summed over the ranks first."""
    import torch.distributed as dist

    spec, ranks = CASES[name], dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    w = reference_weights(spec, SEEDS[name])
    refs = [reference_run(spec, w, *_batch(r)) for r in range(ranks)]
    ref = refs[rank]
    layer = megacann_layer(spec, w)
    x, g = _batch(rank)
    x.requires_grad_()
    out = layer(x)
    stats = layer.last_stats
    ((out * g).sum() + stats.aux_loss).backward()

    errs = {"out": rel(out, ref["out"]), "dx": rel(x.grad, ref["dx"])}
    errs["aux_names"] = float(set(stats.aux_losses) != set(ref["aux"]))
    errs.update({f"aux.{k}": rel(stats.aux_losses[k], v) for k, v in ref["aux"].items()})
    errs["tokens_per_expert"] = float(stats.tokens_per_expert.tolist() != ref["counts"].tolist())
    errs["dropped"] = float(stats.dropped_tokens != ref["dropped"])
    if spec.capacity_factor is not None:  # the data overflows an expert: tokens really drop
        errs["some_dropped"] = float(ref["dropped"] == 0)
    if spec.choice_bias:  # the bias really changed a choice
        errs["bias_changed_choice"] = float(not ref["bias_changed_choice"])
    want = by_megacann_name({k: sum(r["grads"][k] for r in refs) for k in w})
    grads = dict(layer.named_parameters())
    errs["expert_count"] = float(sum(n.startswith("experts.") for n in grads) != 2 * EXPERTS // ranks)
    for pname, p in grads.items():
        grad = p.grad.clone()
        if ranks > 1 and not pname.startswith("experts."):
            dist.all_reduce(grad)
        errs[f"grad.{pname}"] = rel(grad, want[pname])
    return errs


def _assert_small(errs: dict[str, float], where: str) -> None:
    assert any(k.startswith("grad.experts.") for k in errs), errs
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"{where}: {bad}"


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_equals_the_reference(case):
    _assert_small(compare(case), case)


def _ep2_all_cases() -> dict[str, dict[str, float]]:
    from megacann import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        return {name: compare(name) for name in CASES}
    finally:
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def ep2_results() -> list[dict]:
    return run_on_ranks(_ep2_all_cases, world_size=2, timeout=180)


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_2_equals_the_reference(ep2_results, case):
    for rank, per_rank in enumerate(ep2_results):
        _assert_small(per_rank[case], f"{case}, rank {rank}")


def test_capacity_rule_reference_itself():
    """The enumerated rule on a hand-made case: at capacity 3 expert 0 drops its lowest of four; at
    capacity 1 it keeps one of its two 0.9s, the earlier token's, and experts 1 and 2 their best."""
    chosen = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 2]])
    priority = torch.tensor([[0.5, 0.2], [0.9, 0.1], [0.3, 0.9], [0.7, 0.4]])
    keep = capacity_keep(chosen, priority, capacity=3)
    assert keep.tolist() == [[False, True], [True, True], [True, True], [True, True]]
    keep = capacity_keep(chosen, priority, capacity=1)
    assert keep.tolist() == [[False, False], [True, False], [True, False], [False, True]]


# -- transformers' blocks -----------------------------------------------------------------------------


def _torch_moe_weights(block, w: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        block.gate.weight.copy_(w["router"])
        block.experts.gate_up_proj.copy_(w["gate_up"])
        block.experts.down_proj.copy_(w["down"])


def _against_hf(block, spec: Spec, w: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
    """megacann with the same weights gives ``block``'s output and gradients, and so does the reference;
    ``params`` maps megacann names to the block's parameters (or slices of them)."""
    layer = megacann_layer(spec, w)
    x, g = _batch(0)
    ref = reference_run(spec, w, x, g)
    assert ref.get("bias_changed_choice", True)  # with a choice bias, it steered some token
    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = layer(got_x)
    want = block(want_x)
    (out * g).sum().backward()
    (want * g).sum().backward()
    assert rel(out, want) <= TOL and rel(got_x.grad, want_x.grad) <= TOL
    assert rel(ref["out"], want) <= TOL and rel(ref["dx"], want_x.grad) <= TOL
    grads = dict(layer.named_parameters())
    for name, hf_grad in params.items():
        assert rel(grads[name].grad, hf_grad()) <= TOL, name


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_routing_equals_transformers(norm_topk_prob):
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=FFN,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        hidden_act="silu",
    )
    block = modeling.Qwen3MoeSparseMoeBlock(config)
    spec = Spec(normalize=norm_topk_prob)
    w = reference_weights(spec, 7)
    _torch_moe_weights(block, w)
    params = {"router.weight": lambda: block.gate.weight.grad}
    for e in range(EXPERTS):
        params[f"experts.{e}.gate_up_proj.weight"] = lambda e=e: block.experts.gate_up_proj.grad[e]
        params[f"experts.{e}.down_proj.weight"] = lambda e=e: block.experts.down_proj.grad[e]
    _against_hf(block, spec, w, params)


def test_deepseek_v3_routing_equals_transformers():
    """Sigmoid scores, the correction bias for choosing only, renormalised and scaled weights, a shared
    expert (one group, so DeepSeek's group-limited choice chooses among all experts)."""
    modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        hidden_size=HIDDEN,
        moe_intermediate_size=FFN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        hidden_act="silu",
    )
    block = modeling.DeepseekV3MoE(config)
    spec = Spec(score="sigmoid", choice_bias=True, scaling=2.5, shared_ffn=FFN)
    w = reference_weights(spec, 8)
    _torch_moe_weights(block, w)
    shared = block.shared_experts
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.tensor(CHOICE_BIAS))
        gate, up = w["shared_gate_up"].chunk(2)
        shared.gate_proj.weight.copy_(gate)
        shared.up_proj.weight.copy_(up)
        shared.down_proj.weight.copy_(w["shared_down"])
    params = {
        "router.weight": lambda: block.gate.weight.grad,
        "shared_experts.gate_up_proj.weight": lambda: torch.cat(
            [shared.gate_proj.weight.grad, shared.up_proj.weight.grad]
        ),
        "shared_experts.down_proj.weight": lambda: shared.down_proj.weight.grad,
    }
    for e in range(EXPERTS):
        params[f"experts.{e}.gate_up_proj.weight"] = lambda e=e: block.experts.gate_up_proj.grad[e]
        params[f"experts.{e}.down_proj.weight"] = lambda e=e: block.experts.down_proj.grad[e]
    _against_hf(block, spec, w, params)
