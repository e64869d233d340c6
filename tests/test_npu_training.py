"""A tiny llama (2 layers, 3 steps) trains on the NPU route, every op resolved as on an NPU against the fake
torch_npu (tests/fake_torch_npu/), with the loss trace of the reference route within fp32 round-off; with
attention dropout, selective recompute replays the dropout masks (the same trace as without recompute). The
optimizer's AdamW step runs torch_npu's ApplyAdamW; the head's loss stays the vocabulary-parallel one (no
torch_npu kernel covers it), also with the chunked head loss left out of precision.fused_ops.

Older releases (the fake's ``old_api`` modes) train through each fallback with the full API's trace:
packed documents without ``actual_seq_qlen`` (CANN 7.0, 8.0.RC1: one BSND call per document) and MoE
experts on a build refusing ``npu_grouped_matmul(group_type=2)`` (the weight gradient per expert)."""

import pytest
from dist_harness import run_on_ranks

STEPS = 3
BASE = ["model.num_layers=2", f"optim.max_steps={STEPS}", "optim.clip_grad=1.0"]
DROPOUT = ["model.attention_dropout=0.2"]
PACKED = ["data.reset_position_ids=true", "data.reset_attention_mask=true"]  # documents ended by EOS
EXPERTS = ["model.type=moe", "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32"]
PER_OP = ["rms_norm", "apply_rotary", "swiglu", "scaled_dot_product_attention", "cross_entropy", "adamw_step_"]
NEWEST = False  # the fake's old_api value for the newest API
RUNS = {  # name -> (None: the reference route, else the fake's old_api release; overrides)
    "reference": (None, ["precision.fused_ops=false"]),
    "npu": (NEWEST, []),
    "npu_dropout": (NEWEST, DROPOUT),
    "npu_dropout_selective": (NEWEST, [*DROPOUT, "model.activation_checkpointing=selective"]),
    # every fused op but the chunked head loss: the head's loss is the vocabulary-parallel one
    "npu_cross_entropy": (NEWEST, [f"precision.fused_ops=[{','.join(PER_OP)}]"]),
    "reference_packed": (None, ["precision.fused_ops=false", *PACKED]),
    "npu_packed": (NEWEST, PACKED),
    "npu_packed_cann7.0": ("cann7.0", PACKED),
    "npu_packed_cann8.0.rc1": ("cann8.0.rc1", PACKED),
    "npu_experts": (NEWEST, EXPERTS),
    "npu_experts_group_type_2_refused": ("group_type_2_refused", EXPERTS),
}


def _train(runs: dict) -> dict:
    import logging
    import sys
    from collections import Counter

    from fake_torch_npu import forget_npu_checks, make_fake_torch_npu, route_cpu_to_npu
    from layout_fuzz import FuzzData
    from training_helpers import tiny_config

    from megacann import parallel_state as ps
    from megacann.ops import registry
    from megacann.training.runtime import setup_runtime
    from megacann.training.trainer import Trainer

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("megacann.ops").addHandler(handler)
    results = {}
    for name, (release, overrides) in runs.items():
        npu = None
        if release is not None:
            npu = sys.modules["torch_npu"] = make_fake_torch_npu(old_api=release)
            forget_npu_checks()
            route_cpu_to_npu()
        said.clear()
        cfg = tiny_config([*BASE, *overrides], optim={"grad_accum_steps": 1})
        data = FuzzData(cfg, 0, 1, packed=PACKED[0] in overrides)
        trainer = Trainer(cfg, setup_runtime(cfg), data=data)
        losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
        calls = Counter(c.name for c in npu.calls) if npu is not None else Counter()
        kernels = [c for c in npu.calls if c.name in ("npu_fusion_attention", "npu_grouped_matmul")] if npu else []
        params = [p for group in trainer.optimizer.optimizer.param_groups for p in group["params"]]
        results[name] = {
            "losses": losses,
            "calls": dict(calls),
            "layouts": dict(Counter(c.args[4] for c in kernels if c.name == "npu_fusion_attention")),
            "group_types": dict(
                Counter(c.kwargs.get("group_type") for c in kernels if c.name != "npu_fusion_attention")
            ),
            "fallbacks": [line for line in said if "torch_npu" in line],
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


def test_packed_documents_train_alike_without_sequence_lengths(runs):
    """CANN 7.0 and 8.0.RC1 (no actual_seq_qlen): one BSND call per document, the TND run's trace."""
    full = runs["npu_packed"]
    assert full["layouts"] == {"TND": 2 * STEPS} and full["fallbacks"] == []
    _same(full["losses"], runs["reference_packed"]["losses"], 1e-5)
    assert abs(full["losses"][-1] - runs["npu"]["losses"][-1]) > 1e-4  # packing changed the attention
    for release in ("cann7.0", "cann8.0.rc1"):
        old = runs[f"npu_packed_{release}"]
        # 2 rows of 33 tokens, documents ending every 11 tokens from the 8th: 4 per row, 2 layers, 3 steps
        assert old["layouts"] == {"BSND": 2 * 4 * 2 * STEPS}, old["layouts"]
        (line,) = [f for f in old["fallbacks"] if "scaled_dot_product_attention" in f]  # said once
        assert "one BSND call per document" in line
        _same(old["losses"], full["losses"], 1e-6)


def test_experts_train_alike_when_group_type_2_is_refused(runs):
    full, refused = runs["npu_experts"], runs["npu_experts_group_type_2_refused"]
    assert full["fallbacks"] == [] and full["group_types"][2] == full["group_types"][0] / 2 > 0
    # the first weight gradient is refused (then said once), later ones never ask again
    assert refused["group_types"] == {0: full["group_types"][0], 2: 1}, refused["group_types"]
    (line,) = refused["fallbacks"]
    assert "refuses npu_grouped_matmul(group_type=2)" in line and line.endswith("one product per expert from now on")
    _same(refused["losses"], full["losses"], 1e-6)
