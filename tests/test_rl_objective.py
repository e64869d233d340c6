"""The reinforcement-learning objective on one process (CPU, fp32): advantages (GRPO with each reward
scaling, RLOO), the clipped policy loss with truncated importance sampling and each KL estimator against
formulas written here one sequence at a time, the loss and its gradients on a tiny transformers
LlamaForCausalLM loaded into megacann against the same formulas on transformers' logits (each aggregation,
clip-higher on both sides, GSPO), micro-batch accounting, the per-token log-probability pass, the figures and
the errors. Layouts (tp 2 + SP, pp 2, ep 2, dp 2 + ZeRO-1, ZeRO-3, LoRA tp 2): test_rl_objective_parallel.py."""

from __future__ import annotations

import math
import os
import statistics
from types import SimpleNamespace

import pytest
import torch

from megacann.constants import IGNORE_INDEX
from megacann.models.policy_loss import (
    STAT_NAMES,
    PolicyLoss,
    count_policy_normalizer,
    policy_figures,
    policy_forward_step,
    token_logps_forward_step,
)
from megacann.rl.advantages import compute_advantages

# -- advantages -------------------------------------------------------------------------------------------

REWARDS = [[1.0, 0.0, 0.0, 1.0, 1.0], [0.5, 0.5, 2.0, 0.0, 1.5], [3.0, 3.0, 3.0, 3.0, 3.0]]


def test_grpo_advantages_follow_the_formulas():
    rewards = torch.tensor(REWARDS)
    eps = 1e-6
    flat = [r for row in REWARDS for r in row]
    for scaling in ("group", "batch", "none"):
        got = compute_advantages(rewards, "grpo", scaling, eps)
        for g, row in enumerate(REWARDS):
            mean = statistics.fmean(row)
            std = {"group": statistics.stdev(row), "batch": statistics.stdev(flat), "none": 1.0 - eps}[scaling]
            want = [(r - mean) / (std + eps) for r in row]
            assert got[g].tolist() == pytest.approx(want, rel=1e-6, abs=1e-7), (scaling, g)
    assert compute_advantages(rewards)[2].abs().max() == 0.0  # equal rewards: no signal, and no division by 0


def test_rloo_advantages_subtract_the_mean_of_the_others():
    got = compute_advantages(torch.tensor(REWARDS), "rloo")
    for g, row in enumerate(REWARDS):
        want = [r - statistics.fmean(row[:i] + row[i + 1 :]) for i, r in enumerate(row)]
        assert got[g].tolist() == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_advantages_reject_bad_input():
    with pytest.raises(ValueError, match=r"group_size >= 2, got shape \(3, 1\)"):
        compute_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match="advantage estimator 'ppo' is not one of grpo, rloo"):
        compute_advantages(torch.ones(2, 2), "ppo")
    with pytest.raises(ValueError, match="scale_rewards 'prompt' is not one of group, batch, none"):
        compute_advantages(torch.ones(2, 2), "grpo", "prompt")


# -- the loss against formulas written one sequence at a time --------------------------------------------


def reference_loss(loss: PolicyLoss, logp, mask, old, adv, ref=None, rollout=None) -> torch.Tensor:
    """The step's loss by the formulas: each sequence's response tokens taken alone, the sequence ratio in
    its plain form ``exp(mean(lp - old))``, then aggregated over the batch."""
    total, count = 0.0, 0
    for i in range(logp.shape[0]):
        m = mask[i]
        lp, o, n = logp[i][m], old[i][m], int(m.sum())
        if n == 0:
            continue
        ratio = torch.exp((lp - o).mean()).expand(n) if loss.ratio_level == "sequence" else torch.exp(lp - o)
        per_token = -torch.min(adv[i] * ratio, adv[i] * ratio.clamp(1 - loss.clip_low, 1 + loss.clip_high))
        if loss.tis_cap is not None:
            per_token = per_token * torch.exp(o - rollout[i][m]).clamp(max=loss.tis_cap)
        if ref is not None and loss.kl_coef:
            d = ref[i][m] - lp
            per_token = per_token + loss.kl_coef * (-d if loss.kl_estimator == "k1" else torch.exp(d) - d - 1)
        if loss.loss_aggregation == "token_mean":
            total, count = total + per_token.sum(), count + n
        elif loss.loss_aggregation == "seq_mean_token_mean":
            total, count = total + per_token.mean(), count + 1
        else:
            total, count = total + per_token.sum(), count + 1
    return total / count


def perturbed(logp: torch.Tensor, mask: torch.Tensor, amplitude: float, phase: float) -> torch.Tensor:
    """``logp`` moved by a fixed pattern (ratios on both sides of 1), 0 off the response."""
    pattern = torch.sin(torch.arange(logp.numel(), dtype=torch.float32).reshape(logp.shape) * 1.7 + phase)
    return torch.where(mask, logp.detach() + amplitude * pattern, 0.0)


LOSSES = {
    "token_mean": PolicyLoss(0.2, 0.28),
    "seq_mean_token_mean": PolicyLoss(0.2, 0.28, loss_aggregation="seq_mean_token_mean"),
    "seq_mean_token_sum": PolicyLoss(0.1, 0.3, loss_aggregation="seq_mean_token_sum"),
    "gspo": PolicyLoss(0.01, 0.015, ratio_level="sequence", loss_aggregation="seq_mean_token_mean"),
    "gspo_token_mean": PolicyLoss(0.01, 0.015, ratio_level="sequence"),
    "k1": PolicyLoss(0.2, 0.28, kl_coef=0.3, kl_estimator="k1"),
    "k3": PolicyLoss(0.2, 0.28, kl_coef=0.3, kl_estimator="k3", loss_aggregation="seq_mean_token_mean"),
    "tis": PolicyLoss(0.2, 0.28, tis_cap=1.1, kl_coef=0.1),
}
ADVANTAGES = torch.tensor([1.0, -0.5, 0.8, -1.2])
HF_ADVANTAGES = torch.tensor([1.0, -0.5, -0.8, 1.2])  # GSPO's sequence ratios there: 1.04, 1.02, 0.99, 1.05


def synthetic_inputs():
    """Log-probabilities ``[4, 12]`` with responses of 7, 4, 9 and 1 tokens (prompt first, padding after)."""
    g = torch.Generator().manual_seed(5)
    logp = -torch.rand(4, 12, generator=g) * 3
    mask = torch.zeros(4, 12, dtype=torch.bool)
    for i, (start, length) in enumerate([(2, 7), (5, 4), (1, 9), (10, 1)]):
        mask[i, start : start + length] = True
    logp = torch.where(mask, logp, 0.0)
    return logp, mask, perturbed(logp, mask, 0.4, 0.0), perturbed(logp, mask, 0.5, 1.0), perturbed(logp, mask, 0.2, 2.0)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_and_gradient_equal_the_formulas(name):
    loss = LOSSES[name]
    logp, mask, old, ref, rollout = synthetic_inputs()
    mine = logp.clone().requires_grad_(True)
    token_loss, stats = loss(mine, old, ADVANTAGES, mask, ref, rollout)
    count = int(mask.sum()) if loss.loss_aggregation == "token_mean" else 4
    got = token_loss.sum() / count
    theirs = logp.clone().requires_grad_(True)
    want = reference_loss(loss, theirs, mask, old, ADVANTAGES, ref, rollout)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    got.backward(), want.backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-7)
    assert mine.grad.abs().sum() > 0 and (token_loss[~mask] == 0).all()
    s = dict(zip(STAT_NAMES, stats.tolist()))
    assert s["tokens"] == mask.sum() and s["sequences"] == 4
    ratio = torch.exp(logp - old)
    if loss.ratio_level == "sequence":
        seq = torch.stack([torch.exp((logp[i][mask[i]] - old[i][mask[i]]).mean()) for i in range(4)])
        ratio = seq.unsqueeze(-1).expand_as(logp)
    adv = ADVANTAGES.unsqueeze(-1)
    assert s["clipped_low"] == float((mask & (adv < 0) & (ratio < 1 - loss.clip_low)).sum()) > 0
    assert s["clipped_high"] == float((mask & (adv > 0) & (ratio > 1 + loss.clip_high)).sum()) > 0
    assert s["logp_diff"] == pytest.approx(float((logp - rollout).abs()[mask].sum()), rel=1e-6)


def test_kl_estimators_and_tis_weights_equal_their_formulas():
    """Each term alone: with a zero advantage only the KL term is left; TIS weights are min(e^(old-roll), cap)."""
    logp, mask, old, ref, rollout = synthetic_inputs()
    zero = torch.zeros(4)
    for estimator in ("k1", "k3"):
        token_loss, stats = PolicyLoss(kl_coef=1.0, kl_estimator=estimator)(logp, old, zero, mask, ref)
        for i, j in mask.nonzero().tolist():
            d = float(ref[i, j] - logp[i, j])
            want = -d if estimator == "k1" else math.exp(d) - d - 1
            assert float(token_loss[i, j]) == pytest.approx(want, rel=1e-6, abs=1e-7), (estimator, i, j)
        assert float(stats[STAT_NAMES.index("kl")]) == pytest.approx(float(token_loss.sum()), rel=1e-6)
    cap = 1.1
    plain, _ = PolicyLoss()(logp, old, ADVANTAGES, mask)
    weighted, stats = PolicyLoss(tis_cap=cap)(logp, old, ADVANTAGES, mask, rollout_logps=rollout)
    weights = []
    for i, j in mask.nonzero().tolist():
        w = min(math.exp(float(old[i, j] - rollout[i, j])), cap)
        weights.append(w)
        assert float(weighted[i, j]) == pytest.approx(float(plain[i, j]) * w, rel=1e-6, abs=1e-7)
    assert min(weights) < 1.0 and max(weights) == cap  # the pattern reaches the cap and falls below 1
    assert float(stats[STAT_NAMES.index("tis_weight")]) == pytest.approx(sum(weights), rel=1e-6)
    mine = logp.clone().requires_grad_(True)
    PolicyLoss(tis_cap=cap)(mine, old, ADVANTAGES, mask, rollout_logps=rollout)[0].sum().backward()
    again = logp.clone().requires_grad_(True)
    (PolicyLoss()(again, old, ADVANTAGES, mask)[0] * (old - rollout).exp().clamp(max=cap)).sum().backward()
    torch.testing.assert_close(mine.grad, again.grad)  # each token's gradient scaled by its weight


# -- on a transformers model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """The same tiny LLaMA as megacann and as transformers, and a batch of 4 prompts + responses of
    different lengths (padding after)."""
    from finetune_helpers import VOCAB, tiny_hf_base
    from transformers import LlamaForCausalLM

    from megacann.interop.hf import from_pretrained_hf

    path = tiny_hf_base(os.path.join(str(tmp_path_factory.mktemp("rl_hf")), "m"), seed=3)
    ours = from_pretrained_hf(path, precision="fp32")
    theirs = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager")
    ids = torch.randint(0, VOCAB - 4, (4, 17), generator=torch.Generator().manual_seed(1))
    labels = ids[:, 1:].clone()
    for i, (prompt, response) in enumerate([(3, 9), (6, 4), (2, 13), (8, 5)]):
        labels[i, : prompt - 1] = IGNORE_INDEX
        labels[i, prompt - 1 + response :] = IGNORE_INDEX
    tokens = ids[:, :-1]
    batch = {"tokens": tokens, "labels": labels, "position_ids": torch.arange(16).expand(4, 16)}
    return ours, theirs, batch


def hf_logps(model, batch, grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of the labels (0 off the response) and entropies, from transformers."""
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=batch["tokens"]).logits.float()
    mask = batch["labels"] != IGNORE_INDEX
    log_probs = torch.log_softmax(logits, -1)
    logp = log_probs.gather(-1, batch["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return torch.where(mask, logp, 0.0), entropy.detach()


def rollout_batch(batch: dict, logp: torch.Tensor) -> dict:
    """The batch with fixed rollout values: old, reference and rollout log-probabilities near the policy's."""
    mask = batch["labels"] != IGNORE_INDEX
    return {
        **batch,
        "advantages": HF_ADVANTAGES,
        "old_logps": perturbed(logp, mask, 0.4, 0.0),
        "ref_logps": perturbed(logp, mask, 0.5, 1.0),
        "rollout_logps": perturbed(logp, mask, 0.2, 2.0),
    }


GRAD_NAMES = {
    "layers.0.self_attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
    "lm_head.weight": "lm_head.weight",
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_grpo_loss_and_gradients_on_a_transformers_model(llama_pair, name):
    from megacann.models.spec import decoder_forward_step

    ours, theirs, batch = llama_pair
    loss = LOSSES[name]
    ours.zero_grad(), theirs.zero_grad()
    logp, entropy = hf_logps(theirs, batch)
    full = rollout_batch(batch, logp)
    mask = batch["labels"] != IGNORE_INDEX
    want = reference_loss(loss, logp, mask, full["old_logps"], HF_ADVANTAGES, full["ref_logps"], full["rollout_logps"])
    want.backward()
    sink: list = []
    out = policy_forward_step(decoder_forward_step, loss, sink)(ours, full, None)
    got = out.token_loss.sum() / count_policy_normalizer([full], loss.loss_aggregation)[0]
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    hf_params = dict(theirs.named_parameters())
    for mine, hf in GRAD_NAMES.items():
        g, h = dict(ours.named_parameters())[mine].grad, hf_params[hf].grad
        g = g[: h.shape[0]]  # megacann pads the vocabulary
        assert (g - h).norm() <= 1e-5 * h.norm() and h.norm() > 0, mine
    figures = policy_figures({"loss": got.detach(), "policy": out.stats["policy"]}, loss, sink)
    assert float(figures["entropy"]) == pytest.approx(float(entropy[mask].mean()), rel=1e-5)
    diff = (logp.detach() - full["rollout_logps"]).abs()[mask]
    assert float(figures["logp_diff_mean"]) == pytest.approx(float(diff.mean()), rel=1e-5)
    assert float(figures["logp_diff_max"]) == pytest.approx(float(diff.max()), rel=1e-5)
    assert figures["clip_frac_low"] > 0 and figures["clip_frac_high"] > 0  # both sides of the clip were active
    assert ("kl" in figures) == loss.needs_reference and ("tis_weight_mean" in figures) == (loss.tis_cap is not None)


@pytest.mark.parametrize("name", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "k3"])
def test_micro_batches_sum_to_the_whole_batch(llama_pair, name):
    """Split 1 + 3 rows: each micro-batch's token losses over the global normaliser add up to the whole."""
    from megacann.models.spec import decoder_forward_step

    ours, theirs, batch = llama_pair
    loss = LOSSES[name]
    logp, _ = hf_logps(theirs, batch, grad=False)
    full = rollout_batch(batch, logp)
    parts = [{k: v[:1] for k, v in full.items()}, {k: v[1:] for k, v in full.items()}]
    step = policy_forward_step(decoder_forward_step, loss)
    ours.zero_grad()
    whole = step(ours, full, None).token_loss.sum() / count_policy_normalizer([full], loss.loss_aggregation)
    whole.backward()
    expected = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad()
    count = count_policy_normalizer(parts, loss.loss_aggregation)
    assert float(count) == (int((full["labels"] != IGNORE_INDEX).sum()) if name == "token_mean" else 4)
    split = 0.0
    for part in parts:
        part_loss = step(ours, part, None).token_loss.sum() / count
        part_loss.backward()
        split = split + part_loss.detach()
    torch.testing.assert_close(split, whole.detach(), rtol=1e-6, atol=1e-7)
    for n, p in ours.named_parameters():  # norm-wise: other batch shapes round differently
        assert (p.grad - expected[n]).norm() <= 1e-5 * expected[n].norm() and expected[n].norm() > 0, n


def test_token_logps_pass_equals_transformers(llama_pair):
    from megacann.models.spec import decoder_forward_step

    ours, theirs, batch = llama_pair
    sink: list = []
    with torch.no_grad():
        out = token_logps_forward_step(decoder_forward_step, sink)(ours, batch, None)
    want, _ = hf_logps(theirs, batch, grad=False)
    assert len(sink) == 1 and not sink[0].requires_grad and out.token_loss.shape == (4,)
    torch.testing.assert_close(sink[0], want, rtol=1e-5, atol=1e-6)
    assert (sink[0][batch["labels"] == IGNORE_INDEX] == 0).all()


def test_entropy_is_taken_a_few_response_tokens_at_a_time(llama_pair, monkeypatch):
    """Chunks of 7 response tokens give transformers' entropies at the response, 0 elsewhere."""
    from megacann.models import policy_loss

    ours, theirs, batch = llama_pair
    monkeypatch.setattr(policy_loss, "ENTROPY_ROWS", 7)
    seen = []
    hook = ours.lm_head.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        ours(input_ids=batch["tokens"], labels=batch["labels"])
    hook.remove()
    got = policy_loss.response_entropy(ours.lm_head, seen[0], batch["labels"])
    _, want = hf_logps(theirs, batch, grad=False)
    mask = batch["labels"] != IGNORE_INDEX
    assert int(mask.sum()) > 4 * 7  # several chunks, the last one short
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    assert (got[~mask] == 0).all()


# -- configuration and bad input --------------------------------------------------------------------------


def test_from_config_takes_an_object_or_a_dict():
    section = SimpleNamespace(clip_low=0.1, clip_high=0.3, ratio_level="sequence", kl_coef=0.05, other=1)
    assert PolicyLoss.from_config(section) == PolicyLoss(0.1, 0.3, "sequence", kl_coef=0.05)
    got = PolicyLoss.from_config({"loss_aggregation": "seq_mean_token_sum", "kl_estimator": "k1", "tis_cap": 2.0})
    assert got == PolicyLoss(loss_aggregation="seq_mean_token_sum", kl_estimator="k1", tis_cap=2.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"clip_low": 1.0}, r"rl.clip_low 1.0 must be in \[0, 1\)"),
        ({"clip_low": -0.1}, r"rl.clip_low -0.1 must be in \[0, 1\)"),
        ({"clip_high": -0.2}, r"rl.clip_high -0.2 must be >= 0"),
        ({"kl_coef": -1.0}, r"rl.kl_coef -1.0 must be >= 0"),
        ({"tis_cap": 0.0}, r"rl.tis_cap 0.0 must be > 0"),
        ({"ratio_level": "seq"}, r"rl.ratio_level 'seq' is not one of token, sequence"),
        ({"loss_aggregation": "mean"}, r"rl.loss_aggregation 'mean' is not one of token_mean, seq_mean_token_mean"),
        ({"kl_estimator": "k2"}, r"rl.kl_estimator 'k2' is not one of k1, k3"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicyLoss(**kwargs)


def test_missing_inputs_are_named(llama_pair):
    from megacann.models.spec import decoder_forward_step

    ours, _, batch = llama_pair
    with pytest.raises(ValueError, match=r"needs 'old_logps' \(it has: labels, position_ids, tokens\)"):
        policy_forward_step(decoder_forward_step, PolicyLoss())(ours, batch, None)
    logp, mask, old, _, _ = synthetic_inputs()
    with pytest.raises(ValueError, match=r"rl.kl_coef > 0 needs the reference policy's log-probabilities"):
        PolicyLoss(kl_coef=0.1)(logp, old, ADVANTAGES, mask)
    with pytest.raises(ValueError, match=r"rl.tis_cap needs the rollout's log-probabilities"):
        PolicyLoss(tis_cap=2.0)(logp, old, ADVANTAGES, mask)
    with pytest.raises(ValueError, match="rl.loss_aggregation 'sum' is not one of"):
        count_policy_normalizer([batch], "sum")
