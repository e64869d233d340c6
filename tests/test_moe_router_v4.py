"""DeepSeek-V4's routing as router options: ``sqrtsoftplus`` scores and hash routing (token id -> fixed
experts), against transformers' ``DeepseekV4TopKRouter`` / ``DeepseekV4HashRouter`` with the same
weights (choices, gate weights, gradients of the router weight and the tokens in fp32), and a hash-routed
MoE layer under expert parallelism 2 and tensor parallelism 2 (tokens split over the ranks, or sequence
parallel) equal to one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_on_ranks
from layers_reference import full_grad, rel_err

from megacann import parallel_state as ps
from megacann.collectives import all_reduce_if_parallel
from megacann.layers import MoEConfig, MoELayer
from megacann.layers.moe import TopKRouter

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf  # noqa: E402

HIDDEN, EXPERTS, TOP_K, VOCAB, SCALING = 16, 8, 2, 32, 1.5
TOL = 1e-5


def _hf_config():
    return transformers.DeepseekV4Config(
        hidden_size=HIDDEN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        vocab_size=VOCAB,
        routed_scaling_factor=SCALING,
        scoring_func="sqrtsoftplus",
    )


def _hash_table(seed: int) -> torch.Tensor:
    """``[VOCAB, TOP_K]`` distinct random experts per token id."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(VOCAB)])


def _tokens(seed: int = 1, n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, HIDDEN, generator=gen), torch.randint(0, VOCAB, (n,), generator=gen)


def _compare(reference: torch.nn.Module, ours: TopKRouter, x: torch.Tensor, token_ids=None) -> None:
    """Same experts and gate weights (matched by expert id: transformers leaves top-k unsorted), and the same
    gradients of the router weight and the tokens for a random weighting of the gate weights."""
    x_ref, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    _, weights_ref, ids_ref = reference(x_ref) if token_ids is None else reference(x_ref, token_ids)
    routing = ours(x_ours, token_ids=token_ids)
    order_ref, order = ids_ref.argsort(-1), routing.expert_ids.argsort(-1)
    assert torch.equal(ids_ref.gather(1, order_ref), routing.expert_ids.gather(1, order))
    weights_ref, probs = weights_ref.gather(1, order_ref), routing.probs.gather(1, order)
    torch.testing.assert_close(probs, weights_ref, rtol=TOL, atol=1e-7)
    probe = torch.randn(probs.shape, generator=torch.Generator().manual_seed(9))
    (weights_ref * probe).sum().backward()
    (probs * probe).sum().backward()
    torch.testing.assert_close(ours.weight.grad, reference.weight.grad, rtol=TOL, atol=1e-7)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=TOL, atol=1e-7)


def test_sqrtsoftplus_router_matches_transformers():
    reference = hf.DeepseekV4TopKRouter(_hf_config())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=gen))
        reference.e_score_correction_bias.copy_(torch.randn(EXPERTS, generator=gen) * 0.3)
    ours = TopKRouter(
        HIDDEN, EXPERTS, TOP_K, score_function="sqrtsoftplus", routed_scaling_factor=SCALING, expert_bias=True
    )
    names = {"weight": "weight", "e_score_correction_bias": "expert_bias"}  # transformers' name -> ours
    ours.load_state_dict({names[k]: v for k, v in reference.state_dict().items()})
    x, _ = _tokens()
    logits = x @ reference.weight.detach().t()
    torch.testing.assert_close(
        ours(x).scores.sort(-1).values,
        torch.sqrt(torch.log1p(torch.exp(logits))).gather(1, ours(x).expert_ids).sort(-1).values,
        rtol=1e-6,
        atol=0,
    )
    _compare(reference, ours, x)


def test_hash_router_matches_transformers():
    reference = hf.DeepseekV4HashRouter(_hf_config())
    with torch.no_grad():
        reference.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(0)))
        reference.tid2eid.copy_(_hash_table(5))
    ours = TopKRouter(HIDDEN, EXPERTS, TOP_K, score_function="sqrtsoftplus", routed_scaling_factor=SCALING,
                      hash_vocab_size=VOCAB)  # fmt: skip
    names = {"weight": "weight", "tid2eid": "token_to_experts"}
    ours.load_state_dict({names[k]: v for k, v in reference.state_dict().items()})
    x, token_ids = _tokens()
    assert torch.equal(ours(x, token_ids=token_ids).expert_ids, _hash_table(5)[token_ids])  # the table decides
    _compare(reference, ours, x, token_ids)


def test_hash_routing_default_table_and_refusals():
    router = TopKRouter(HIDDEN, EXPERTS, 3, hash_vocab_size=5)
    assert router.token_to_experts.tolist() == [[(3 * t + j) % EXPERTS for j in range(3)] for t in range(5)]
    with pytest.raises(ValueError, match="hash routing needs the ids of the 12 tokens it routes, got none"):
        router(torch.zeros(12, HIDDEN))
    with pytest.raises(ValueError, match="hash routing needs the ids of the 12 tokens it routes, got 11"):
        router(torch.zeros(12, HIDDEN), token_ids=torch.zeros(11, dtype=torch.long))
    with pytest.raises(ValueError, match=r"MoEConfig.hash_vocab_size=5: .*bias_update_rate"):
        MoEConfig(hidden_size=HIDDEN, num_experts=EXPERTS, ffn_hidden_size=8, hash_vocab_size=5, bias_update_rate=0.1)
    with pytest.raises(ValueError, match=r"score_function='sqrt_softplus' is not one of .*did you mean 'sqrtsoftplus'"):
        MoEConfig(hidden_size=HIDDEN, num_experts=EXPERTS, ffn_hidden_size=8, score_function="sqrt_softplus")
    with pytest.raises(ValueError, match="TopKRouter: score_function 'tanh' is not one of"):
        TopKRouter(HIDDEN, EXPERTS, 2, score_function="tanh")


SEED, BATCH, SEQ = 3, 2, 6
HASH_MOE = dict(
    hidden_size=HIDDEN, num_experts=EXPERTS, ffn_hidden_size=8, top_k=TOP_K, score_function="sqrtsoftplus",
    routed_scaling_factor=SCALING, hash_vocab_size=VOCAB, num_shared_experts=1, aux_loss_coeff=0.01,
)  # fmt: skip


def _batch(d: int):
    gen = torch.Generator().manual_seed(40 + d)
    x, grad = torch.randn(BATCH, SEQ, HIDDEN, generator=gen), torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    return x, grad, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


LAYOUTS = {  # tp, ep, MoEConfig overrides: experts spread over 2 ranks, or whole with the tokens split over TP
    "ep2": (1, 2, {}),
    "tp2_whole_experts": (2, 1, dict(expert_tensor_parallel=False)),
    "tp2_sequence_parallel": (2, 1, dict(sequence_parallel=True)),
}


def _shard(t: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=1)[tp_rank]


def _run(layer: MoELayer, d: int, shard=lambda t: t) -> dict:
    """Output, input gradient and auxiliary loss of data-parallel rank ``d``'s batch, cut by ``shard`` (a
    sequence-parallel rank's part); gradients accumulate."""
    x, grad, token_ids = (shard(t) for t in _batch(d))
    x.requires_grad_(True)
    out = layer(x, token_ids)
    ((out * grad).sum() + layer.last_stats.aux_loss).backward()
    return {"out": out.detach(), "dx": x.grad, "aux": layer.last_stats.aux_loss.detach()}


def _check_layout(tp: int, ep: int, overrides: dict) -> dict[str, float]:
    cfg = MoEConfig(**HASH_MOE, **overrides)
    table, dp = _hash_table(7), dist.get_world_size() // tp
    torch.manual_seed(SEED)
    one = MoELayer(MoEConfig(**HASH_MOE))  # one process: every data-parallel rank's batch, gradients summed
    one.router.token_to_experts.copy_(table)
    ref = [_run(one, m) for m in range(dp)]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    d, ep_rank, tp_rank = (
        ps.get_data_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
    )
    shard = (lambda t: _shard(t, tp, tp_rank)) if cfg.sequence_parallel else (lambda t: t)
    torch.manual_seed(SEED)
    layer = MoELayer(cfg)
    layer.router.token_to_experts.copy_(table)
    received = {}
    forward = layer.experts.forward
    layer.experts.forward = lambda x, counts: received.setdefault("counts", list(counts)) and forward(x, counts)
    got = _run(layer, d, shard)
    errs = {key: rel_err(got[key], shard(ref[d][key]) if key != "aux" else ref[d][key]) for key in got}
    reference_params = dict(one.named_parameters())
    for name, param in layer.named_parameters():
        grad = full_grad(param)  # TP shards joined, TP-partial gradients summed
        expert = name.startswith("experts.")
        all_reduce_if_parallel(grad, ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group())
        errs[f"grad.{name}"] = rel_err(grad, reference_params[name].grad)
    # the layout was in force: this rank's experts, fed the tokens the table sent them from every rank
    local = range(ep_rank * EXPERTS // ep, (ep_rank + 1) * EXPERTS // ep)
    errs["local_experts"] = float(list(layer.experts) != [str(e) for e in local])
    members = [None] * ep
    dist.all_gather_object(members, d, group=ps.get_expert_model_parallel_group())
    split = tp > 1 and not cfg.expert_tensor_parallel  # each TP rank routes its own part of the sequence

    def routed_here(m: int) -> list[int]:
        token_ids = _shard(_batch(m)[2], tp, tp_rank) if split else _batch(m)[2]
        return torch.bincount(table[token_ids].reshape(-1), minlength=EXPERTS)[list(local)].tolist()

    expected = [sum(counts) for counts in zip(*(routed_here(m) for m in members))]
    errs["received"] = float(received["counts"] != expected)
    if ep > 1:
        errs["others_routed_here"] = float(expected == routed_here(d))
    if split:
        whole = torch.bincount(table[_batch(d)[2]].reshape(-1), minlength=EXPERTS).tolist()
        errs["tokens_split"] = float(expected == whole)
    ps.destroy_model_parallel()
    dist.barrier()
    return errs


def _layout_checks() -> dict[str, dict[str, float]]:
    return {name: _check_layout(*layout) for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_on_ranks(_layout_checks, world_size=2, timeout=240)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hash_routed_moe_layout_equals_one_process(results, layout):
    for rank, per_rank in enumerate(results):
        errs = per_rank[layout]
        assert any(k.startswith("grad.experts.") for k in errs) and "grad.router.weight" in errs
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"{layout}, rank {rank}: {bad}"
