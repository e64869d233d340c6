"""Expert parallelism on 4 gloo ranks equals the plain-PyTorch MoE reference of tests/test_moe_reference.py:
for ep 4, ep 2 (x expert-data-parallel 2), ep 2 with capacity dropping, and ep 2 x tp 2 with experts split
over TP (sequence parallel, dropless and with capacity) or whole on every TP rank, the MoE layer gives the
reference's outputs, input gradients, auxiliary losses, token counts, dropped tokens and (summed over
data-parallel ranks) weight gradients, starts from the weights one process starts from, moves its balancing
biases by the documented rule, and each rank's experts receive the tokens the other ranks routed to them.

One spawn runs every layout (``_layout_checks``); the reference runs in the same processes, on every
data-parallel rank's batch in turn, from the weights a one-process layer is initialised with (so nothing it
computes comes from the layer under test). The same spawn runs the example of docs/moe.md, whose losses must
equal those of one process.
"""

from __future__ import annotations

import pathlib
import re
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_on_ranks
from layers_reference import full_grad, full_param, rel_err
from test_moe_reference import Spec, by_megacann_name, reference_run

from megacann import parallel_state as ps
from megacann.collectives import all_reduce_if_parallel
from megacann.layers import MoEConfig, MoELayer
from megacann.layers.moe import update_expert_biases

TOL = 1e-5
SEED, BATCH, SEQ, HIDDEN, FFN, EXPERTS = 11, 2, 8, 16, 8, 8
BALANCING = dict(aux_loss_coeff=0.01, z_loss_coeff=0.001, bias_update_rate=0.01)
LAYOUTS = {
    "ep4": dict(tp=1, ep=4, moe=dict(num_shared_experts=1, **BALANCING)),
    "ep2": dict(tp=1, ep=2, moe=dict(score_function="sigmoid", routed_scaling_factor=2.0, top_k=3, **BALANCING)),
    "ep2_capacity": dict(tp=1, ep=2, moe=dict(capacity_factor=1.0, aux_loss_coeff=0.01)),
    "ep2_tp2_sp": dict(tp=2, ep=2, moe=dict(sequence_parallel=True, num_shared_experts=1, **BALANCING)),
    "ep2_tp2_sp_capacity": dict(
        tp=2, ep=2, moe=dict(sequence_parallel=True, num_shared_experts=1, capacity_factor=1.0, **BALANCING)
    ),
    "ep2_tp2_whole_experts": dict(
        tp=2, ep=2, moe=dict(expert_tensor_parallel=False, num_shared_experts=1, **BALANCING)
    ),
}


def _batch(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``d``'s input and the gradient its output gets."""
    gen = torch.Generator().manual_seed(100 + d)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=gen), torch.randn(BATCH, SEQ, HIDDEN, generator=gen)


def _shard(t: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=1)[tp_rank]


def _reference(cfg: MoEConfig, dp: int) -> dict:
    """The plain-PyTorch reference of tests/test_moe_reference.py (nothing of megacann's layer) run on each
    data-parallel rank's batch in turn, from the weights a one-process MoELayer starts with: per batch its
    output, input gradient, auxiliary losses, token counts, dropped tokens and choices; the weight gradients
    summed over the batches (under megacann's names); the expert biases after one balancing step, by the
    rule docs/moe.md states (``bias_e += rate * sign(mean load - load_e)``, loads over every batch)."""
    torch.manual_seed(SEED)
    layer = MoELayer(replace(cfg, sequence_parallel=False))
    init = {name: p.detach().clone() for name, p in layer.named_parameters()}
    experts = range(cfg.num_experts)
    w = {
        "router": init["router.weight"],
        "gate_up": torch.stack([init[f"experts.{e}.gate_up_proj.weight"] for e in experts]),
        "down": torch.stack([init[f"experts.{e}.down_proj.weight"] for e in experts]),
    }
    if cfg.num_shared_experts:
        w["shared_gate_up"] = init["shared_experts.gate_up_proj.weight"]
        w["shared_down"] = init["shared_experts.down_proj.weight"]
    spec = Spec(
        top_k=cfg.top_k,
        score=cfg.score_function,
        normalize=cfg.normalize_top_k,
        scaling=cfg.routed_scaling_factor,
        capacity_factor=cfg.capacity_factor,
        aux_coeff=cfg.aux_loss_coeff,
        z_coeff=cfg.z_loss_coeff,
    )
    runs = [reference_run(spec, w, *_batch(d)) for d in range(dp)]
    loads = sum(run["counts"] for run in runs).double()
    bias = cfg.bias_update_rate * torch.sign(loads.mean() - loads)
    grads = by_megacann_name({k: sum(run["grads"][k] for run in runs) for k in w})
    return {"init": init, "runs": runs, "grads": grads, "bias": bias.float()}


def _routed_counts(ids: torch.Tensor, capacity_factor) -> torch.Tensor:
    """Assignments per expert in ``ids`` (capped at the capacity of a forward of those tokens)."""
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    if capacity_factor is not None:
        capacity = -(-int(capacity_factor * ids.numel()) // EXPERTS)
        counts = counts.clamp(max=capacity)
    return counts


def _check_layout(tp: int, ep: int, moe: dict) -> dict[str, float]:
    cfg = MoEConfig(hidden_size=HIDDEN, num_experts=EXPERTS, ffn_hidden_size=FFN, **moe)
    dp = dist.get_world_size() // tp
    ref = _reference(cfg, dp)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    tp_rank, d = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    torch.manual_seed(SEED)
    layer = MoELayer(cfg).train()
    received = {}
    forward = layer.experts.forward
    layer.experts.forward = lambda x, counts: received.setdefault("counts", list(counts)) and forward(x, counts)

    x, g = _batch(d)
    run = ref["runs"][d]
    ref_out, ref_dx = run["out"], run["dx"]
    if cfg.sequence_parallel:
        x, g, ref_out, ref_dx = (_shard(t, tp, tp_rank) for t in (x, g, ref_out, ref_dx))
    x.requires_grad_()
    out = layer(x)
    stats = layer.last_stats
    ((out * g).sum() + stats.aux_loss).backward()

    errs = {"out": rel_err(out, ref_out), "dx": rel_err(x.grad, ref_dx)}
    errs["aux_names"] = float(set(stats.aux_losses) != set(run["aux"]))
    for key, value in run["aux"].items():
        errs[f"aux.{key}"] = rel_err(stats.aux_losses[key], value)
    if cfg.capacity_factor is not None:  # the data really overflows an expert
        errs["dropped_some"] = float(stats.dropped_tokens == 0 or stats.dropped_tokens != run["dropped"])
    errs["tokens_per_expert"] = float(stats.tokens_per_expert.tolist() != run["counts"].tolist())
    for name, p in layer.named_parameters():
        errs[f"init.{name}"] = float(not torch.equal(full_param(p), ref["init"][name]))
        grad = full_grad(p)  # TP shards joined, TP-partial gradients summed
        expert = name.startswith("experts.")
        all_reduce_if_parallel(grad, ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group())
        errs[f"grad.{name}"] = rel_err(grad, ref["grads"][name])

    # the experts here computed what every rank of this expert-parallel group routed to them
    ep_rank, local = ps.get_expert_model_parallel_rank(), EXPERTS // ep
    errs["local_experts"] = float(
        list(layer.experts) != [str(e) for e in range(ep_rank * local, (ep_rank + 1) * local)]
    )
    members = [None] * ep
    dist.all_gather_object(members, d, group=ps.get_expert_model_parallel_group())
    whole_experts = tp > 1 and not cfg.expert_tensor_parallel  # each TP rank routes its own shard

    def routed_here(m: int) -> torch.Tensor:
        chosen = ref["runs"][m]["chosen"].view(BATCH, SEQ, -1)  # each token's experts [b, s, k]
        ids = _shard(chosen, tp, tp_rank) if whole_experts else chosen
        return _routed_counts(ids, cfg.capacity_factor)[ep_rank * local : (ep_rank + 1) * local]

    expected = sum(routed_here(m) for m in members).tolist()
    errs["received"] = float(received["counts"] != expected)
    errs["others_routed_here"] = float(expected == routed_here(d).tolist())  # the data makes it a real exchange

    if cfg.bias_update_rate > 0:
        update_expert_biases(layer)
        errs["expert_bias"] = float(not torch.equal(layer.router.expert_bias, ref["bias"]))
        errs["expert_bias_moved"] = float(layer.router.expert_bias.abs().sum().item() == 0)
    ps.destroy_model_parallel()
    return errs


DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "moe.md"


def _doc_example() -> list[float]:
    code = "\n".join(re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S))
    namespace = {"__name__": "docs_moe_example"}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace["main"]()


def _layout_checks() -> dict:
    results = {name: _check_layout(**layout) for name, layout in LAYOUTS.items()}
    results["doc_example"] = _doc_example()
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_on_ranks(_layout_checks, world_size=4, timeout=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(results, layout):
    for rank, per_rank in enumerate(results):
        errs = per_rank[layout]
        assert any(k.startswith("grad.experts.") for k in errs) and "received" in errs
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"{layout}, rank {rank}: {bad}"


def test_doc_example_same_losses_on_one_and_four_ranks(results):
    one = run_on_ranks(_doc_example, world_size=1, timeout=120)[0]
    assert len(one) == 3 and one[-1] < one[0], one  # it trains
    for per_rank in results:
        assert per_rank["doc_example"] == pytest.approx(one, rel=TOL)
