"""megacann-plan on DeepSeek-V3.2 (model.type deepseek_v32): every layer's lightning indexer is held whole on
every TP rank, so the planner's parameters per device equal the built model's, at tp 1 and tp 2; and its
activations (the indexer's keys, queries and per-key scores over the whole sequence on every TP rank, the
top-k selection and the indexer loss's log-probabilities and target) against the peak of what autograd
saves in a run: fp32 to 4 bytes, bf16 within 0.5%, tp 2 + SP within 0.5% (extended tier); with the indexer
loss off (only the sparse attention's top-k mask, nothing left saved after the step) within 0.5% too; the
warm-up (only the indexers train) exactly: their gradients and optimizer states, and their saved inputs and
terms alone."""

import pytest
import torch
from dist_harness import run_on_ranks
from test_planner import COMMON, _compare, _measure
from test_planner_mla import MLA
from training_helpers import tiny_config

from megacann.models import get_model_spec
from megacann.models.spec import ChunkPlacement
from megacann.pipeline.plan import build_plan
from megacann.planning import estimate_stages, layout_of
from megacann.planning.estimate import replay_in_flight

INDEXER = ["model.index_n_heads=2", "model.index_head_dim=8", "model.index_topk=8"]
V32 = ["model.type=deepseek_v32", "model.rotary_interleaved=true", *MLA[1:], *INDEXER]  # MLA[0]: its type
RUNS_1 = {
    "v32 fp32": [*COMMON, *V32],
    "v32 bf16": [*COMMON, *V32, "model.precision=bf16"],
    "v32 indexer loss off": [*COMMON, *V32, "model.indexer_loss_coeff=0"],  # only the top-k mask, nothing left
}
WARMUP = [*COMMON, *V32, "model.indexer_warmup=true"]  # only the indexers train and save
RUNS_2 = {
    "v32 tp2 sp fp32": [*COMMON, *V32, "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
}


def test_indexer_parameters_are_planned_whole_on_every_tp_rank():
    """At tp 1 the planner's count equals the built model's trainable parameters; at tp 1 and tp 2 it is
    DeepSeek-V3's of the same keys plus the indexers whole (wq_b, wk, k_norm's weight and bias, weights_proj)."""
    indexers = 4 * (24 * 2 * 8 + 64 * 8 + 2 * 8 + 64 * 2)  # 4 layers
    for tp in (1, 2):
        layout = [f"distributed.tensor_parallel_size={tp}"]
        cfg = tiny_config([*V32, *layout], world_size=tp)
        planned = estimate_stages(cfg, layout_of(cfg))[0].params
        dense = tiny_config([*MLA, *layout], world_size=tp)
        assert planned == estimate_stages(dense, layout_of(dense))[0].params + indexers, tp
        if tp == 1:
            with torch.device("meta"):
                model = get_model_spec("deepseek_v32").build(cfg, ChunkPlacement((0, 1, 2, 3)), "meta")
            assert planned == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_indexer_activations_match_one_rank():
    _compare(RUNS_1, run_on_ranks(_measure, 1, args=(RUNS_1,), timeout=600), 1)


def test_warmup_plans_the_indexers_alone():
    """The warm-up: gradients and optimizer states of the indexers only (the optimizer holds them alone:
    4 layers x 1040 parameters) beside the whole model's weights, and a peak of saved bytes that is the
    indexers' terms alone, exactly (planned before as joint training: 5x the measured peak)."""
    (_, memory, peak, live) = run_on_ranks(_measure, 1, args=({"warm-up": WARMUP},), timeout=600)[0]["warm-up"]
    cfg = tiny_config(WARMUP, world_size=1)
    layout = layout_of(cfg)
    stage = estimate_stages(cfg, layout)[0]
    assert memory["params"] == 4 * 1040 * 4 and stage.weights == 4 * stage.params
    assert (memory["grads"], memory["optimizer_states"]) == (stage.grads, stage.optimizer) == (4 * 4160, 8 * 4160)
    plan = build_plan(layout.pp, 0, layout.num_microbatches, None)
    assert live == 0 and peak == replay_in_flight(plan, stage.chunk_saved)[0]


@pytest.mark.extended
def test_indexer_activations_match_tp2_with_sequence_parallelism():
    _compare(RUNS_2, run_on_ranks(_measure, 2, args=(RUNS_2,), timeout=600), 2)
