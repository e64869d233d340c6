"""megacann-plan on gpt-oss (model.type gpt_oss): the attention sinks (split with the heads), the router's
bias and the experts' biases (gate|up split over TP, down whole, experts spread over EP) in the planner's
weight, gradient and optimizer bytes, against the tensors real runs hold on one rank, under tensor +
sequence parallelism and under expert parallelism; and its activations against the bytes autograd saves:
the sink attention's probabilities over s + 1 columns (in the weights' dtype), its boolean mask and its kv
heads expanded to the query heads (all dropped by selective recompute), and the clamped SwiGLU's three
tensors more a row, on one rank to 0.5% (fp32: to 4 bytes; bf16: the fp32 copy of the router's weight is
not counted), under tp 2 + SP to 0.5%, under ep 2 to 10% (a tiny random router is not balanced)."""

import pytest
from dist_harness import run_on_ranks
from test_planner import COMMON, _measure, planned_in_flight, planned_stages

GPT_OSS = [
    *COMMON,
    "optim.grad_accum_steps=2",
    "model.type=gpt_oss",
    "model.head_dim=16",
    "model.ffn_hidden_size=32",
    "model.num_experts=4",
    "model.moe_top_k=2",
    "model.sliding_window=16",
    "model.layer_types=[sliding_attention,full_attention,sliding_attention,full_attention]",
]
RUNS_1 = {
    "gpt_oss fp32": GPT_OSS,
    "gpt_oss bf16 selective": [*GPT_OSS, "model.precision=bf16", "model.activation_checkpointing=selective"],
}
TOLERANCE = {"gpt_oss ep2": 0.10}  # the rows an expert-parallel rank's experts receive: unbalanced here
RUNS_2 = {
    "gpt_oss tp2 sp": [*GPT_OSS, "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
    "gpt_oss ep2": [*GPT_OSS, "distributed.expert_parallel_size=2"],
}


def _compare(runs: dict[str, list[str]], world: int) -> list[float]:
    """The planner's weight, gradient and optimizer bytes equal the optimizer's tensors on every rank, and its
    activations the peak of what autograd saved (within 0.5%, or the run's TOLERANCE); the ratios."""
    results = run_on_ranks(_measure, world, args=(runs,), timeout=600)
    ratios = []
    for name, overrides in runs.items():
        layout, stages = planned_stages(overrides, world)
        for rank_result in results:
            stage_index, memory, peak, live = rank_result[name]
            stage = stages[stage_index]
            planned = (stage.weights, stage.grads, stage.optimizer)
            assert (memory["params"], memory["grads"], memory["optimizer_states"]) == planned, (name, memory)
            predicted = planned_in_flight(layout, stage_index, stage)
            assert live == 0 and abs(peak - predicted) / peak < TOLERANCE.get(name, 0.005), (name, peak, predicted)
            ratios.append(predicted / peak)
    return ratios


def test_gpt_oss_is_planned_on_one_rank():
    _compare(RUNS_1, 1)


@pytest.mark.extended
def test_gpt_oss_is_planned_under_tp_and_ep():
    _compare(RUNS_2, 2)
