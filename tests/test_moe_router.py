"""The top-k router against a hand-computed case: choices, weights, auxiliary losses and their
gradients, bias-based balancing, and capacity dropping.

The tokens are the rows of an identity matrix, so the router logits are the rows of its weight and the
scores can be set exactly."""

from __future__ import annotations

import math

import pytest
import torch

from megacann.layers.moe import MoEConfig, TopKRouter, capacity_mask, expert_capacity

# scores per token (softmax of these logits gives them back); the shifts set logsumexp per token
SCORES = [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.1, 0.5, 0.1, 0.3], [0.6, 0.2, 0.1, 0.1]]
SHIFTS = [1.0, 0.0, 2.0, -1.0]


def _router(logits, **kwargs) -> TopKRouter:
    logits = torch.tensor(logits, dtype=torch.float64)
    router = TopKRouter(logits.shape[0], logits.shape[1], **kwargs)
    with torch.no_grad():
        router.weight.data = logits.t().clone().contiguous()  # weight[e, t] = logit of token t for e
    return router


def _softmax_router(**kwargs) -> TopKRouter:
    logits = [[math.log(p) + shift for p in row] for row, shift in zip(SCORES, SHIFTS)]
    return _router(logits, top_k=2, **kwargs)


def test_softmax_top2_choices_and_normalised_weights():
    router = _softmax_router()
    routing = router(torch.eye(4, dtype=torch.float64))
    assert routing.expert_ids.tolist() == [[0, 1], [3, 2], [1, 3], [0, 1]]
    expected = [[0.4 / 0.7, 0.3 / 0.7], [0.4 / 0.7, 0.3 / 0.7], [0.5 / 0.8, 0.3 / 0.8], [0.6 / 0.8, 0.2 / 0.8]]
    torch.testing.assert_close(routing.probs, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(routing.scores[0], torch.tensor([0.4, 0.3], dtype=torch.float64), rtol=1e-12, atol=0)
    assert routing.tokens_per_expert.tolist() == [2, 3, 1, 2]
    assert routing.aux_losses == {}  # no coefficients, no losses
    unnormalised = _softmax_router(normalize_top_k=False)(torch.eye(4, dtype=torch.float64))
    torch.testing.assert_close(unnormalised.probs[2], torch.tensor([0.5, 0.3], dtype=torch.float64), rtol=1e-12, atol=0)


def test_load_balancing_and_z_loss_values_and_gradients():
    coeff, z_coeff = 0.01, 0.001
    router = _softmax_router(aux_loss_coeff=coeff, z_loss_coeff=z_coeff)
    routing = router(torch.eye(4, dtype=torch.float64))
    # f = [2, 3, 1, 2] / 8; P = column means of SCORES = [0.3, 0.3, 0.175, 0.225]
    # 4 * sum(f * P) = 4 * (0.6 + 0.9 + 0.175 + 0.45) / 8 = 1.0625
    lb = routing.aux_losses["load_balancing"]
    assert lb.item() == pytest.approx(1.0625 * coeff, rel=1e-12)
    z = routing.aux_losses["z_loss"]
    assert z.item() == pytest.approx(z_coeff * (1 + 0 + 4 + 1) / 4, rel=1e-12)
    # d lb / d logit[t, e] = c * p[t,e] * (g_e - sum_i p[t,i] g_i), g = 4 * f / N (N = 4 tokens)
    p = torch.tensor(SCORES, dtype=torch.float64)
    g = 4 * torch.tensor([2, 3, 1, 2], dtype=torch.float64) / 8 / 4
    d_lb = coeff * p * (g - (p * g).sum(1, keepdim=True))
    # d z / d logit[t, e] = c * 2 * lse_t * p[t, e] / N
    d_z = z_coeff * 2 * torch.tensor(SHIFTS, dtype=torch.float64).unsqueeze(1) * p / 4
    (grad,) = torch.autograd.grad(lb + z, router.weight)
    torch.testing.assert_close(grad.t(), d_lb + d_z, rtol=1e-10, atol=1e-15)  # weight[e, t] <-> logit[t, e]


def test_sigmoid_scores_scaling_and_bias_steer_choice_only():
    logits = [[math.log(a) for a in (1, 3, 1 / 3, 1 / 4)]]  # sigmoid: 0.5, 0.75, 0.25, 0.2
    router = _router(logits, top_k=2, score_function="sigmoid", routed_scaling_factor=2.0, bias_update_rate=0.1)
    x = torch.eye(1, dtype=torch.float64)
    routing = router(x)
    assert routing.expert_ids.tolist() == [[1, 0]]
    torch.testing.assert_close(
        routing.probs, torch.tensor([[1.2, 0.8]], dtype=torch.float64), rtol=1e-12, atol=0
    )  # 2 * (.6, .4)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.6, 0.0]))
    routing = router(x)
    assert routing.expert_ids.tolist() == [[2, 1]]  # 0.25 + 0.6 beats 0.75 ...
    torch.testing.assert_close(
        routing.probs, torch.tensor([[0.5, 1.5]], dtype=torch.float64), rtol=1e-12, atol=0
    )  # ... weights unbiased


def test_sigmoid_load_balancing_uses_scores_normalised_per_token():
    logits = [[math.log(a) for a in (1, 3, 1 / 3, 1 / 4)]]
    routing = _router(logits, top_k=1, score_function="sigmoid", aux_loss_coeff=1.0)(torch.eye(1, dtype=torch.float64))
    # one token, expert 1 chosen: f = [0, 1, 0, 0]; P_1 = 0.75 / (0.5 + 0.75 + 0.25 + 0.2)
    assert routing.aux_losses["load_balancing"].item() == pytest.approx(4 * 0.75 / 1.7, rel=1e-12)
    torch.testing.assert_close(
        routing.probs, torch.tensor([[0.75]], dtype=torch.float64), rtol=1e-12, atol=0
    )  # top-1: not normalised


def test_bias_update_moves_towards_balance_from_the_counted_load():
    router = _softmax_router(bias_update_rate=0.05)
    x = torch.eye(4, dtype=torch.float64)
    router.train()
    router(x)
    router(x)
    assert router.load_since_update.tolist() == [4, 6, 2, 4]  # two forwards of [2, 3, 1, 2]
    router.eval()
    router(x)  # evaluation does not count
    router.update_expert_bias()
    # mean load 4: expert 1 over (down), expert 2 under (up), experts 0 and 3 exactly fair (unchanged)
    torch.testing.assert_close(router.expert_bias, torch.tensor([0.0, -0.05, 0.05, 0.0]))
    assert router.load_since_update.tolist() == [0, 0, 0, 0]
    assert "expert_bias" in router.state_dict() and "load_since_update" not in router.state_dict()
    with pytest.raises(RuntimeError, match="bias-based balancing is off"):
        _softmax_router().update_expert_bias()


def test_capacity_keeps_the_highest_scores_per_expert_ties_to_the_earlier_token():
    expert_ids = torch.tensor([[0], [0], [0], [0], [0], [1]])
    scores = torch.tensor([[0.6], [0.9], [0.7], [0.9], [0.55], [0.8]])
    assert expert_capacity(6, 1, 2, 1.0) == 3
    keep = capacity_mask(scores, expert_ids, 2, capacity=3)
    assert keep.view(-1).tolist() == [False, True, True, True, False, True]
    keep = capacity_mask(scores, expert_ids, 2, capacity=1)
    assert keep.view(-1).tolist() == [False, True, False, False, False, True]  # 0.9 tie: token 1 wins
    # top-2: each slot competes in its own expert
    ids2 = torch.tensor([[0, 1], [1, 0], [0, 1]])
    scores2 = torch.tensor([[0.5, 0.4], [0.7, 0.2], [0.6, 0.3]])
    assert capacity_mask(scores2, ids2, 2, capacity=2).tolist() == [[True, True], [True, False], [True, False]]
    assert expert_capacity(10, 2, 8, 1.25) == math.ceil(1.25 * 10 * 2 / 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(top_k=5), r"top_k must be in \[1, num_experts=4\], got 5"),
        (dict(score_function="sigmod"), "did you mean 'sigmoid'"),
        (dict(capacity_factor=0.0), "capacity_factor must be > 0"),
        (dict(aux_loss_coeff=-1.0), "aux_loss_coeff must be >= 0"),
        (dict(num_shared_experts=-1), "num_shared_experts must be >= 0"),
    ],
)
def test_config_errors_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(hidden_size=8, num_experts=4, ffn_hidden_size=8, **kwargs)
