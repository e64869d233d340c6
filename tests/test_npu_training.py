"""A tiny llama (2 layers, 3 steps) trains on the NPU route, every op resolved as on an NPU against the fake
torch_npu (tests/fake_torch_npu.py), with the loss trace of the reference route within fp32 round-off; with
attention dropout, selective recompute replays the dropout masks (the same trace as without recompute). The
optimizer's AdamW step runs torch_npu's ApplyAdamW; the head's loss stays the vocabulary-parallel one (no
torch_npu kernel covers it), also with the chunked head loss left out of precision.fused_ops."""

import pytest
from dist_harness import run_on_ranks

STEPS = 3
BASE = ["model.num_layers=2", f"optim.max_steps={STEPS}", "optim.clip_grad=1.0"]
DROPOUT = ["model.attention_dropout=0.2"]
PER_OP = ["rms_norm", "apply_rotary", "swiglu", "scaled_dot_product_attention", "cross_entropy", "adamw_step_"]
RUNS = {  # name -> (on the fake NPU route, overrides)
    "reference": (False, ["precision.fused_ops=false"]),
    "npu": (True, []),
    "npu_dropout": (True, DROPOUT),
    "npu_dropout_selective": (True, [*DROPOUT, "model.activation_checkpointing=selective"]),
    # every fused op but the chunked head loss: the head's loss is the vocabulary-parallel one
    "npu_cross_entropy": (True, [f"precision.fused_ops=[{','.join(PER_OP)}]"]),
}


def _train(runs: dict) -> dict:
    import sys

    from fake_torch_npu import forget_npu_checks, make_fake_torch_npu, route_cpu_to_npu
    from training_helpers import SyntheticData, tiny_config

    from megacann import parallel_state as ps
    from megacann.ops import registry
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    results = {}
    for name, (on_npu, overrides) in runs.items():
        npu = None
        if on_npu:
            npu = sys.modules["torch_npu"] = make_fake_torch_npu()
            forget_npu_checks()
            route_cpu_to_npu()
        cfg = tiny_config([*BASE, *overrides], optim={"grad_accum_steps": 1})
        trainer = Trainer(cfg, setup_runtime(cfg), data=SyntheticData(cfg, 0, 1))
        losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
        calls = {} if npu is None else {c.name: 0 for c in npu.calls}
        for c in npu.calls if npu is not None else ():
            calls[c.name] += 1
        params = [p for group in trainer.optimizer.optimizer.param_groups for p in group["params"]]
        results[name] = {
            "losses": losses,
            "calls": calls,
            "selection": registry.selection("npu"),
            "params": len(params),
        }
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(_train, 1, args=(RUNS,), timeout=600)[0]


def _same(actual: list, expected: list, rel: float) -> None:
    assert len(actual) == len(expected) == STEPS, (actual, expected)
    for a, e in zip(actual, expected):
        assert abs(a - e) <= rel * abs(e), (actual, expected)


def test_the_npu_route_trains_like_the_reference(runs):
    npu = runs["npu"]
    for op in ("rms_norm", "apply_rotary", "swiglu", "scaled_dot_product_attention"):
        assert npu["selection"][op].split()[0] == "npu", npu["selection"]
    per_forward = 2 * STEPS  # one call per layer per step
    assert npu["calls"]["npu_fusion_attention"] == per_forward, npu["calls"]
    assert npu["calls"]["npu_rotary_mul"] == 2 * per_forward  # q and k
    assert npu["calls"]["npu_rms_norm"] == (2 * 2 + 1) * STEPS  # two per layer and the final norm
    assert runs["reference"]["calls"] == {}
    _same(npu["losses"], runs["reference"]["losses"], 1e-5)


def test_attention_dropout_replays_under_selective_recompute(runs):
    plain, selective = runs["npu_dropout"], runs["npu_dropout_selective"]
    # recompute is on: each layer's attention runs again in backward
    assert selective["calls"]["npu_fusion_attention"] == 2 * plain["calls"]["npu_fusion_attention"]
    _same(selective["losses"], plain["losses"], 1e-6)
    assert abs(plain["losses"][-1] - runs["npu"]["losses"][-1]) > 1e-4  # dropout is really on


def test_the_optimizer_step_runs_the_npu_kernel(runs):
    npu, ce = runs["npu"], runs["npu_cross_entropy"]
    assert npu["params"] > 5
    for run in (npu, ce):  # one ApplyAdamW per parameter tensor per step
        assert run["calls"]["npu_apply_adam_w"] == run["params"] * STEPS, run["calls"]
    for run in (npu, ce):  # the chunked head loss, or the vocabulary-parallel loss: no NPU kernel
        assert "npu_cross_entropy_loss" not in run["calls"]
    assert ce["calls"]["npu_fusion_attention"] == npu["calls"]["npu_fusion_attention"]
    _same(ce["losses"], runs["reference"]["losses"], 1e-5)
