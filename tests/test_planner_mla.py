"""megacann-plan on multi-head latent attention (model.type deepseek_v3): the planner's weight, gradient and
optimizer bytes and its activation bytes against the tensors a run holds and autograd saves, on one rank
and under tensor + sequence parallelism (the latents whole on every rank), with q and v heads of different
widths (the padded core attention)."""

import pytest
from dist_harness import run_on_ranks
from test_planner import COMMON, _compare, _measure

MLA = [
    "model.type=deepseek_v3",
    "model.num_key_value_heads=4",
    "model.q_lora_rank=24",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=8",
    "model.qk_rope_head_dim=4",
    "model.v_head_dim=6",
    "model.num_experts=4",
    "model.moe_top_k=2",
    "model.n_group=2",
    "model.topk_group=1",
    "model.moe_ffn_hidden_size=32",
    "model.moe_shared_experts=1",
    "model.first_k_dense_replace=2",
]
RUNS_1 = {"mla fp32": [*COMMON, *MLA]}
RUNS_2 = {
    "mla tp2 sp fp32": [*COMMON, *MLA, "distributed.tensor_parallel_size=2", "distributed.sequence_parallel=true"],
}


def test_latent_attention_estimates_match_one_rank():
    _compare(RUNS_1, run_on_ranks(_measure, 1, args=(RUNS_1,), timeout=600), 1)


@pytest.mark.extended
def test_latent_attention_estimates_match_tp2_with_sequence_parallelism():
    _compare(RUNS_2, run_on_ranks(_measure, 2, args=(RUNS_2,), timeout=600), 2)
