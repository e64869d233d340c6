"""DPO (train_mode: dpo) on one process, CPU, fp32: the losses and rewards equal a plain-PyTorch computation
on transformers models (policy and reference), LoRA's reference is the frozen base bit for bit, a resumed
run continues bit for bit, precomputed reference log-probabilities equal the on-the-fly ones, and the
metrics hold rewards, margins and accuracy. Layouts (tp 2, pp 2, dp 2 + ZeRO-1, cp 2): test_dpo_parallel.py."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import torch.nn.functional as F
from finetune_helpers import COMMON, LORA, random_words, recipe, write_jsonl

from megacann.constants import IGNORE_INDEX


def write_pairs(path: str, count: int = 48, seed: int = 0) -> str:
    """Reversal questions with the right answer chosen and a near miss rejected."""
    rng = random.Random(seed)
    pairs = []
    for word in random_words(rng, count):
        wrong = word if rng.random() < 0.5 else word[::-1][1:] + word[-1]
        pairs.append({"prompt": f"Reverse: {word}", "chosen": word[::-1], "rejected": wrong})
    return write_jsonl(path, pairs)


def dpo_overrides(path: str, tmp: str, *extra: str) -> list[str]:
    return [
        *COMMON,
        "train_mode=dpo",
        f"data.path={path}",
        "data.prompt_template=plain",
        f"data.cache_dir={tmp}/cache",
        "data.split=90,10,0",
        "data.batch_size=4",
        "dpo.beta=0.5",
        *extra,
    ]


def _trainer(overrides: list[str], **sections):
    from megacann.training.trainer import Trainer

    cfg = recipe(overrides, **sections)
    return Trainer(cfg)


# -- the loss against transformers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models_and_batch(tmp_path_factory):
    """A megacann policy and reference (different seeds), the same weights as transformers models, and a
    micro-batch of two pairs from the data path."""
    from finetune_helpers import tiny_hf_base
    from transformers import LlamaForCausalLM

    from megacann.data import build_data_iterators
    from megacann.data.tokenizer import load_tokenizer
    from megacann.interop.hf import from_pretrained_hf

    tmp = str(tmp_path_factory.mktemp("dpo_hf"))
    ours, theirs = [], []
    for seed in (3, 5):
        path = tiny_hf_base(os.path.join(tmp, f"m{seed}"), seed=seed)
        ours.append(from_pretrained_hf(path, precision="fp32").eval())
        theirs.append(LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").eval())
    cfg = recipe(dpo_overrides(write_pairs(os.path.join(tmp, "p.jsonl")), tmp))
    batch = next(build_data_iterators(cfg, load_tokenizer("byte")).train)
    return ours, theirs, batch


def _plain_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence log-probabilities of the labelled tokens and their counts, by hand."""
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits.float()
    labels = batch["labels"]
    mask = labels != IGNORE_INDEX
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logp * mask).sum(-1), mask.sum(-1).float()


@pytest.mark.parametrize(
    "loss_type, smoothing, sft",
    [("sigmoid", 0.0, 0.0), ("sigmoid", 0.2, 0.0), ("ipo", 0.0, 0.0), ("simpo", 0.1, 0.0), ("sigmoid", 0.0, 0.7)],
)
def test_losses_and_rewards_equal_plain_pytorch_on_transformers_models(models_and_batch, loss_type, smoothing, sft):
    from megacann.models.preference_loss import PreferenceLoss, preference_forward_step, reference_forward_step
    from megacann.models.spec import decoder_forward_step

    (policy, reference), (hf_policy, hf_reference), batch = models_and_batch
    beta, gamma = 0.3, 0.4
    objective = PreferenceLoss(loss_type, beta, smoothing, gamma, sft_loss_weight=sft)
    batch = dict(batch)
    sink: list = []
    with torch.no_grad():
        reference_forward_step(decoder_forward_step, sink)(reference, batch, None)
        batch["ref_logps"] = sink[0]
        out = preference_forward_step(decoder_forward_step, objective)(policy, batch, None)

    pi, n = _plain_logps(hf_policy, batch)
    ref, _ = _plain_logps(hf_reference, batch)
    if loss_type == "sigmoid":
        h = (pi[0::2] - ref[0::2]) - (pi[1::2] - ref[1::2])
        want = -(1 - smoothing) * F.logsigmoid(beta * h) - smoothing * F.logsigmoid(-beta * h)
        chosen, rejected = beta * (pi[0::2] - ref[0::2]), beta * (pi[1::2] - ref[1::2])
    elif loss_type == "ipo":
        avg, ref_avg = pi / n, ref / n
        h = (avg[0::2] - ref_avg[0::2]) - (avg[1::2] - ref_avg[1::2])
        want = (h - 1 / (2 * beta)) ** 2
        chosen, rejected = beta * (avg[0::2] - ref_avg[0::2]), beta * (avg[1::2] - ref_avg[1::2])
    else:
        avg = pi / n
        h = beta * (avg[0::2] - avg[1::2]) - gamma
        want = -(1 - smoothing) * F.logsigmoid(h) - smoothing * F.logsigmoid(-h)
        chosen, rejected = beta * avg[0::2], beta * avg[1::2]
    want = want + sft * (-pi[0::2] / n[0::2])  # dpo.sft_loss_weight: the chosen answers' mean token NLL
    assert out.token_loss.shape == (2,)
    torch.testing.assert_close(out.token_loss, want, rtol=1e-5, atol=1e-6)
    pairs, chosen_sum, rejected_sum, correct = out.stats["preference"].tolist()
    assert pairs == 2 and correct == float((chosen > rejected).sum())
    torch.testing.assert_close(
        torch.tensor([chosen_sum, rejected_sum]), torch.stack([chosen.sum(), rejected.sum()]), rtol=1e-5, atol=1e-6
    )
    assert abs(float(want.mean())) > 1e-3 and abs(float(chosen.sum())) > 1e-3  # policy and reference differ


# -- LoRA: the reference is the frozen base --------------------------------------------------------------


def test_lora_reference_is_the_frozen_base_bit_for_bit(tmp_path):
    from megacann.layers.lora import adapters_disabled
    from megacann.training.preference import build_reference_copy

    path = write_pairs(str(tmp_path / "p.jsonl"))
    trainer = _trainer(dpo_overrides(path, str(tmp_path), *LORA, f"experiment.output_dir={tmp_path}/out"))
    assert trainer.objective.kind == "adapters_off" and trainer.objective.reference is None  # no second copy
    for _ in range(2):
        trainer.train_step()
    adapters = [p for n, p in trainer.model_chunks[0].named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in adapters)  # the adapters moved: the policy is not the base
    batch = {k: v for k, v in next(trainer.data.train).items()}
    base = build_reference_copy(trainer.cfg, trainer.model_spec, trainer.device)  # the seed base, no adapters
    got = trainer.objective.reference_logps([dict(batch)])[0]
    want = trainer.objective.reference_logps([dict(batch)], base, adapters_disabled([]))[0]
    assert torch.equal(got, want)
    chunk = trainer.model_chunks[0].eval()
    with torch.no_grad(), adapters_disabled([chunk]):
        off = chunk(input_ids=batch["tokens"])
    with torch.no_grad():
        assert torch.equal(off, base[0](input_ids=batch["tokens"]))
        assert not torch.equal(chunk(input_ids=batch["tokens"]), off)  # adapters back on afterwards


# -- a run: metrics, resume, precomputed reference -----------------------------------------------------------


def _fit(out: str, overrides: list[str], resume_from=None):
    from megacann.training.trainer import Trainer

    cfg = recipe([*overrides, f"experiment.output_dir={out}"])
    trainer = Trainer(cfg)
    if resume_from:
        trainer.resume(resume_from)
    return trainer.fit(), trainer


FIGURES = ("loss", "chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy", "grad_norm")


@pytest.mark.extended
def test_a_dpo_run_logs_rewards_and_resumes_bit_for_bit(tmp_path):
    path = write_pairs(str(tmp_path / "p.jsonl"))
    base = dpo_overrides(
        path,
        str(tmp_path),
        "optim.max_steps=4",
        "logging.ckpt_interval=2",
        "logging.eval_interval=4",
        "logging.eval_iters=1",
    )
    straight, _ = _fit(str(tmp_path / "a"), base)
    steps = [r for r in straight if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    first = steps[0]
    assert abs(first["loss"] - torch.log(torch.tensor(2.0)).item()) < 1e-6  # policy = reference at step 1
    assert first["chosen_reward"] == first["rejected_reward"] == first["reward_margin"] == 0.0
    assert steps[-1]["reward_margin"] > 0 and steps[-1]["loss"] < first["loss"]  # the policy learns the preference
    evals = [r for r in straight if "eval_loss" in r]
    assert len(evals) == 1 and 0.0 <= evals[0]["eval_reward_accuracy"] <= 1.0
    with open(tmp_path / "a" / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert all(k in logged[-2] for k in FIGURES) and "eval_reward_margin" in logged[-1]

    resumed, _ = _fit(str(tmp_path / "b"), base, resume_from=str(tmp_path / "a" / "checkpoint_2"))
    again = [r for r in resumed if "loss" in r]
    assert [r["step"] for r in again] == [3, 4]
    for a, b in zip(steps[2:], again):
        assert [a[k] for k in FIGURES] == [b[k] for k in FIGURES]


@pytest.mark.extended
def test_precomputed_reference_log_probs_equal_the_copy_and_are_cached(tmp_path):
    path = write_pairs(str(tmp_path / "p.jsonl"))
    base = dpo_overrides(path, str(tmp_path), "optim.max_steps=3")
    copy, _ = _fit(str(tmp_path / "copy"), base)
    pre, trainer = _fit(str(tmp_path / "pre"), [*base, "dpo.reference=precomputed"])
    assert trainer.objective.reference is None
    tables = list((tmp_path / "cache").rglob("dpo-ref-*.npy"))
    assert (
        len(tables) == 1
        and tables[0].parent == (tmp_path / "cache" / "index")
        and "computed over 96 sequences" in trainer.objective.table_note
    )
    for a, b in zip(copy, pre):
        for key in FIGURES:
            assert abs(a[key] - b[key]) <= 1e-5 * max(abs(a[key]), 1e-3), (key, a, b)
    _, later = _fit(str(tmp_path / "pre2"), [*base, "dpo.reference=precomputed", "optim.max_steps=1"])
    assert "from " in later.objective.table_note  # the second run reads the stored values


def test_simpo_builds_no_reference(tmp_path):
    path = write_pairs(str(tmp_path / "p.jsonl"))
    trainer = _trainer(dpo_overrides(path, str(tmp_path), "dpo.loss_type=simpo"))
    assert trainer.objective.kind == "none" and trainer.objective.reference is None
    result = trainer.train_step()
    assert result["loss"] > 0 and "reward_accuracy" in result
