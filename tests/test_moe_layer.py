"""The MoE layer in one process: equal to a per-token loop over its experts (outputs, input and weight
gradients), capacity dropping end to end, expert weights independent of the expert-parallel layout,
inside a transformer block with full recompute, and the stats / auxiliary-loss API."""

from __future__ import annotations

import pytest
import torch
from layers_reference import rel_err

from megacann.layers import MoEConfig, MoELayer, TransformerBlock, TransformerBlockConfig
from megacann.layers.moe import GroupedExperts, MoEStats, moe_aux_loss, moe_layers
from megacann.layers.sharding import get_sharding

HIDDEN, FFN, EXPERTS = 16, 8, 4


def _config(**kwargs) -> MoEConfig:
    base = dict(hidden_size=HIDDEN, num_experts=EXPERTS, ffn_hidden_size=FFN, top_k=2)
    return MoEConfig(**{**base, **kwargs})


def per_token_loop(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Every token through each of its chosen experts one at a time, weighted and summed."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = layer.router(tokens)
    rows = []
    for t in range(tokens.shape[0]):
        row = sum(
            routing.probs[t, j] * layer.experts[str(int(routing.expert_ids[t, j]))](tokens[t : t + 1])[0]
            for j in range(layer.config.top_k)
        )
        rows.append(row)
    out = torch.stack(rows)
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(tokens)
    return out.view_as(x)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_shared_experts=1, aux_loss_coeff=0.01, z_loss_coeff=0.001),
        dict(score_function="sigmoid", routed_scaling_factor=2.5, top_k=3, bias_update_rate=0.01),
    ],
)
def test_layer_equals_per_token_loop(kwargs):
    torch.manual_seed(0)
    layer = MoELayer(_config(**kwargs))
    x = torch.randn(2, 6, HIDDEN, requires_grad=True)
    out = layer(x)
    grad = torch.randn_like(out)
    params = dict(layer.named_parameters())
    got = torch.autograd.grad(out, [x, *params.values()], grad, allow_unused=True)
    x2 = x.detach().requires_grad_()
    ref = per_token_loop(layer, x2)
    want = torch.autograd.grad(ref, [x2, *params.values()], grad, allow_unused=True)
    assert rel_err(out, ref) < 1e-6
    for name, g, w in zip(["input", *params], got, want):
        assert (g is None) == (w is None), name
        if g is not None:
            assert rel_err(g, w) < 1e-5, name


def test_capacity_drops_exactly_the_lowest_scored_assignments():
    torch.manual_seed(0)
    layer = MoELayer(_config(top_k=1, num_experts=2))
    with torch.no_grad():  # token t's logits: (z_t, 0), so expert 0 scores sigmoid(z_t)
        layer.router.weight.zero_()
        layer.router.weight[0, :6] = torch.tensor([0.4, 2.2, 0.8, 2.2, 0.2, -1.0])
    x = torch.randn(1, 6, HIDDEN)
    x[0, :, :6] = torch.eye(6)  # the router sees only this part (its other columns are zero)
    dropless = layer(x)
    seen = {}
    original = layer.experts.forward

    def recording(inp, tokens_per_expert):
        seen["counts"] = list(tokens_per_expert)
        return original(inp, tokens_per_expert)

    layer.experts.forward = recording
    layer.config.capacity_factor = 1.0  # capacity ceil(6 * 1 / 2) = 3; expert 0 is chosen by tokens 0-4
    dropped = layer(x)
    assert seen["counts"] == [3, 1]
    assert layer.last_stats.dropped_tokens == 2
    assert layer.last_stats.tokens_per_expert.tolist() == [5, 1]  # counted before dropping
    # expert 0 keeps tokens 1 and 3 (score sigmoid(2.2)) and 2 (sigmoid(0.8)); tokens 0 and 4 lose it
    assert dropped[0, [0, 4]].abs().max().item() == 0.0
    torch.testing.assert_close(dropped[0, [1, 2, 3, 5]], dropless[0, [1, 2, 3, 5]], rtol=1e-6, atol=1e-9)
    layer.config.capacity_factor = 1 / 3  # capacity 1: the tie at 2.2 goes to the earlier token, 1
    dropped = layer(x)
    assert seen["counts"] == [1, 1]
    assert dropped[0, [0, 2, 3, 4]].abs().max().item() == 0.0
    torch.testing.assert_close(dropped[0, [1, 5]], dropless[0, [1, 5]], rtol=1e-6, atol=1e-9)


def test_expert_weights_do_not_depend_on_the_expert_parallel_layout():
    torch.manual_seed(3)
    whole = MoELayer(_config())
    layer_seed = 1234
    common = (EXPERTS, HIDDEN, FFN, whole.experts["0"].gate_up_proj.weight.megacann_init)
    out_init = whole.experts["0"].down_proj.weight.megacann_init
    one = GroupedExperts(*common, out_init, layer_seed)
    for ep_size in (2, 4):
        for ep_rank in range(ep_size):
            part = GroupedExperts(*common, out_init, layer_seed, ep_rank=ep_rank, ep_size=ep_size)
            assert list(part.expert_indices) == list(range(ep_rank * 4 // ep_size, (ep_rank + 1) * 4 // ep_size))
            for name, p in part.named_parameters():
                assert torch.equal(p, one.get_parameter(name)), (ep_size, name)
                assert get_sharding(p).expert and not get_sharding(p).tp_partial_grad
    names = [n for n, _ in whole.named_parameters()]
    assert names == ["router.weight"] + [
        f"experts.{e}.{p}.weight" for e in range(4) for p in ("gate_up_proj", "down_proj")
    ]
    assert not get_sharding(whole.router.weight).expert
    assert not torch.equal(one["0"].gate_up_proj.weight, one["1"].gate_up_proj.weight)
    with pytest.raises(ValueError, match="num_experts 4 is not divisible by expert_model_parallel_size 3"):
        GroupedExperts(*common, out_init, layer_seed, ep_rank=0, ep_size=3)


def test_block_with_moe_mlp_and_full_recompute_counts_once():
    block_cfg = dict(hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=32)
    moe_cfg = _config(aux_loss_coeff=0.01, bias_update_rate=0.1)
    x = torch.randn(2, 6, HIDDEN)
    results = []
    for recompute in ("none", "full"):
        torch.manual_seed(0)
        block = TransformerBlock(TransformerBlockConfig(recompute=recompute, **block_cfg), mlp=MoELayer(moe_cfg))
        assert block.mlp is moe_layers(block)[0]
        xi = x.clone().requires_grad_()
        out = block(xi)
        stats = block.mlp.last_stats
        (out.square().mean() + moe_aux_loss(block)).backward()
        assert block.mlp.last_stats is stats  # the recompute in backward leaves the stats alone
        load = block.mlp.router.load_since_update.clone()
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in block.named_parameters()}, load))
    (out0, dx0, g0, load0), (out1, dx1, g1, load1) = results
    assert load0.sum().item() == 2 * 6 * 2 and torch.equal(load0, load1)  # 12 tokens x top-2, counted once
    torch.testing.assert_close(out1, out0, rtol=0, atol=0)
    torch.testing.assert_close(dx1, dx0, rtol=1e-6, atol=1e-8)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-6, atol=1e-8)


def test_stats_api():
    torch.manual_seed(0)
    layer = MoELayer(_config(aux_loss_coeff=0.02, z_loss_coeff=0.001))
    assert layer.last_stats is None and moe_aux_loss(layer).item() == 0.0
    layer(torch.randn(1, 4, HIDDEN))
    stats = layer.last_stats
    assert set(stats.aux_losses) == {"load_balancing", "z_loss"}
    assert stats.aux_losses["load_balancing"].requires_grad
    torch.testing.assert_close(stats.aux_loss, stats.aux_losses["load_balancing"] + stats.aux_losses["z_loss"])
    other = MoELayer(_config(aux_loss_coeff=0.5))
    other(torch.randn(1, 4, HIDDEN))
    model = torch.nn.Sequential(layer, torch.nn.Linear(2, 2), other)
    assert moe_layers(model) == [layer, other]
    torch.testing.assert_close(moe_aux_loss(model), stats.aux_loss + other.last_stats.aux_loss)
    assert stats.tokens_per_expert.sum().item() == 4 * 2 and stats.dropped_tokens == 0
    assert MoEStats().aux_loss.item() == 0.0
