"""megacann-plan on MoE families and on heads of ``head_dim`` other than hidden / heads: the planner's
weight, gradient and optimizer-state bytes per rank against the tensors a 4-rank gloo run holds (expert
parallelism 2, with and without ZeRO-1), its activation bytes against what autograd saves, and the command
on the real Mixtral 8x7B and Qwen3-30B-A3B recipes (a report, with the dry run's parameter count)."""

import os

import pytest
import torch
from dist_harness import run_on_ranks
from test_planner import COMMON, ROOT, _compare, _measure

from megacann.cli import plan_main
from megacann.models import ChunkPlacement, get_model_spec
from megacann.pipeline.plan import build_plan
from megacann.planning import estimate_stages, layout_of, rank_layouts
from megacann.planning.estimate import replay_in_flight
from megacann.planning.formulas import layer_parameters_per_rank

MOE_MODEL = [
    "model.type=moe",
    "model.num_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_hidden_size=32",
    "model.moe_shared_experts=1",
    "model.moe_layer_freq=2",  # layers 0 and 2 MoE, 1 and 3 dense
]
MOE = [*MOE_MODEL, "distributed.expert_parallel_size=2", "optim.grad_accum_steps=2"]
RUNS = {
    "moe ep2 dp4 fp32": [*COMMON, *MOE],
    "moe ep2 dp4 zero1 bf16": [*COMMON, *MOE, "distributed.zero_optimization=1", "model.precision=bf16"],
    "moe tp2 sp ep2 zero1": [
        *COMMON,
        *MOE,
        "distributed.tensor_parallel_size=2",
        "distributed.sequence_parallel=true",
        "distributed.zero_optimization=1",
    ],
}
# activations: as many rows as the rank's experts receive, which the planner takes balanced (T x top_k);
# a tiny random router is not, so the 4-rank runs are within 10%, one rank (ep 1) exact
ACTIVATION_TOLERANCE = 0.10


@pytest.mark.extended
def test_moe_estimates_match_the_tensors_of_four_ranks():
    from training_helpers import tiny_config

    results = run_on_ranks(_measure, 4, args=(RUNS,), timeout=600)
    for name, overrides in RUNS.items():
        cfg = tiny_config(overrides, world_size=4)
        layout = layout_of(cfg)
        assert layout.ep == 2 and layout.expert_zero_shards == layout.dp // 2
        stages = estimate_stages(cfg, layout)
        for rank_result in results:
            stage_index, memory, peak, live = rank_result[name]
            stage = stages[stage_index]
            assert stage.expert_params > 0 and live == 0
            # exact: ZeRO's buckets (dense over dp x cp, experts over dp / ep x cp ranks) need no padding here
            measured = (memory["params"], memory["grads"], memory["optimizer_states"])
            assert measured == (stage.weights, stage.grads, stage.optimizer), (name, stage_index, measured, stage)
            plan = build_plan(layout.pp, stage_index, layout.num_microbatches, None)
            predicted, _ = replay_in_flight(plan, stage.chunk_saved)
            assert abs(peak - predicted) / peak < ACTIVATION_TOLERANCE, (name, peak, predicted)


def test_head_dim_and_one_rank_moe_are_planned_to_the_byte():
    """Mistral / Qwen3 heads of head_dim 24 (hidden 64 / 4 heads = 16), and Qwen2's q, k, v biases: the
    planner's per-layer parameters equal the built layer's; on one rank the activations of that Mistral
    and of the tiny MoE equal autograd's to the byte (_compare allows 0.5%)."""
    from training_helpers import tiny_config

    for family, width in (("mistral", ["model.head_dim=24"]), ("qwen3", ["model.head_dim=24"]), ("qwen2", [])):
        cfg = tiny_config([f"model.type={family}", *width])  # and Qwen2's q, k, v biases, Qwen3's q/k norms
        spec = get_model_spec(family)
        with torch.device("meta"):
            model = spec.build(cfg, ChunkPlacement((0,), False, False), "meta")
        built = sum(p.numel() for p in model.layers["0"].parameters())
        assert layer_parameters_per_rank(cfg.model, 1) == (built, 0), family
        if width:  # q and o projections of hidden x heads x head_dim, halved by tp 2
            halved = layer_parameters_per_rank(cfg.model, 1)[0] - layer_parameters_per_rank(cfg.model, 2)[0]
            assert halved >= 64 * 4 * 24
    runs = {
        "mistral head_dim 24": [*COMMON, "model.type=mistral", "model.head_dim=24", "optim.grad_accum_steps=2"],
        "moe ep1": [*COMMON, *MOE_MODEL, "optim.grad_accum_steps=2"],  # every routed row on this rank: exact
    }
    _compare(runs, run_on_ranks(_measure, 1, args=(runs,), timeout=300), 1)


def _plan(recipe: str, capsys) -> str:
    """megacann-plan's entry point in-process (tests/test_planner.py starts the installed command)."""
    args = ["--config", os.path.join(ROOT, recipe), "--world_size", "64", "--device_memory_gb", "64"]
    code = plan_main(args)
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    return out


@pytest.mark.parametrize(
    "recipe, total",
    [
        ("examples/configs/moe/mixtral_8x7b.yaml", "46,702,792,704"),
        pytest.param("examples/configs/qwen3_moe/qwen3_30b_a3b.yaml", "30,532,122,624", marks=pytest.mark.extended),
    ],
)
def test_megacann_plan_reports_the_real_moe_recipes(recipe, total, capsys):
    out = _plan(recipe, capsys)
    assert f"{total} parameters" in out and "active per token" in out
    assert "(ep 8)" in out and "the experts' by dp / ep 1" in out
    assert "activations per MoE layer and micro-batch" in out
    ranked = [line for line in out.splitlines() if line[:3] == " 1."]
    assert len(ranked) == 1 and "of 57.6 GB" in ranked[0]


def test_the_layout_search_keeps_expert_parallelism_valid():
    from training_helpers import tiny_config

    cfg = tiny_config([*MOE, "model.num_experts=6", "data.batch_size=2", "optim.grad_accum_steps=4"], world_size=4)
    ranked = rank_layouts(cfg, 8, 64e9)
    eps = {r.layout.ep for r in ranked}
    assert eps == {1, 2}  # 6 experts: ep 4 and 8 are left out
    assert all(r.layout.dp % r.layout.ep == 0 for r in ranked)


def test_the_moe_structure_follows_changes_to_the_config():
    """The planner keeps the last config's MoE structure: a changed field, also a list changed in place, must
    be seen at the next call."""
    from training_helpers import tiny_config

    from megacann.planning.formulas import moe_structure

    m = tiny_config([*MOE_MODEL]).model
    assert moe_structure(m).moe_layers == (True, False, True, False)
    assert moe_structure(m) is moe_structure(m)
    m.moe_layer_freq = [0, 1, 1, 0]
    assert moe_structure(m).moe_layers == (False, True, True, False)
    m.moe_layer_freq[0] = 1
    assert moe_structure(m).moe_layers == (True, True, True, False)
    m.num_experts = 8
    assert moe_structure(m).num_experts == 8
