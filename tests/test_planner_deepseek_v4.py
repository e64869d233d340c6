"""megacann-plan on DeepSeek-V4 (model.type deepseek_v4): the weight, gradient and optimizer bytes the planner
gives each rank equal the tensors real runs hold, on one rank, under tensor + sequence parallelism (heads,
sinks and the grouped output projection split; the q_a path, the KV head, compressors, indexer,
hyper-connections and the router whole), expert parallelism and pipeline parallelism (the hyper-connection
head on the last stage); its activations are refused by name, never a wrong number."""

import pytest
from dist_harness import run_on_ranks
from test_deepseek_v4 import V4
from test_planner import COMMON, _measure
from training_helpers import tiny_config

from megacann.config import ConfigError
from megacann.planning import layout_of
from megacann.planning.report import plan_report
from megacann.planning.static_memory import refuse_activations, static_stages

V4_PLANNED = [
    *COMMON,
    *V4,
    "model.layer_types=[sliding_attention,heavily_compressed_attention,compressed_sparse_attention,"
    "heavily_compressed_attention]",
]
RUNS_1 = {"deepseek_v4 fp32": V4_PLANNED, "deepseek_v4 bf16": [*V4_PLANNED, "model.precision=bf16"]}
RUNS_2 = {
    "deepseek_v4 tp2 sp": [*V4_PLANNED, "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
    "deepseek_v4 tp2 bf16": [*V4_PLANNED, "distributed.tensor_parallel_size=2", "model.precision=bf16"],
    "deepseek_v4 ep2": [*V4_PLANNED, "distributed.expert_parallel_size=2"],
    "deepseek_v4 pp2": [*V4_PLANNED, "distributed.pipeline_parallel_size=2", "optim.grad_accum_steps=2"],
}


def _compare_static(runs: dict[str, list[str]], world: int) -> dict[str, list[int]]:
    """Each rank's optimizer tensors equal the planner's bytes for its stage, exactly; each run's parameters
    per rank (probes that the layout was in force)."""
    results = run_on_ranks(_measure, world, args=(runs,), timeout=600)
    held = {}
    for name, overrides in runs.items():
        cfg = tiny_config(overrides, world_size=world)
        layout = layout_of(cfg)
        stages = static_stages(cfg, layout)
        assert sorted({r[name][0] for r in results}) == list(range(layout.pp)), name  # every stage ran
        for rank_result in results:
            stage_index, memory, _, _ = rank_result[name]
            planned = stages[stage_index]
            measured = (memory["params"], memory["grads"], memory["optimizer_states"])
            assert measured == (planned["weights"], planned["grads"], planned["optimizer"]), (name, memory, planned)
        held[name] = [stage["params"] for stage in stages]
    return held


def test_deepseek_v4_static_memory_is_exact_on_one_rank():
    _compare_static(RUNS_1, 1)


@pytest.mark.extended
def test_deepseek_v4_static_memory_is_exact_under_tp_ep_pp():
    held = _compare_static(RUNS_2, 2)
    cfg = tiny_config(V4_PLANNED, world_size=1)
    whole = static_stages(cfg, layout_of(cfg))[0]
    for name, per_stage in held.items():  # each layout divides the model: heads, experts or layers
        assert max(per_stage) < whole["params"], (name, per_stage, whole["params"])
    assert sum(held["deepseek_v4 pp2"]) == whole["params"]  # stages partition the model (untied head)


def test_deepseek_v4_plan_reports_static_memory_and_refuses_activations():
    cfg = tiny_config(V4_PLANNED, world_size=1)
    with pytest.raises(ConfigError, match="model.type 'deepseek_v4': megacann-plan has no activation formulas"):
        refuse_activations(cfg.model)
    report = plan_report(cfg, None, 1, None)
    stage = static_stages(cfg, layout_of(cfg))[0]
    assert f"{stage['params']:,}" in report
    assert "activations: not estimated for model.type 'deepseek_v4'" in report
    with pytest.raises(ConfigError, match="--device_memory_gb is refused for model.type 'deepseek_v4'"):
        plan_report(cfg, None, 1, 80.0)
