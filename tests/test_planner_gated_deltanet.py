"""megacann-plan on Gated DeltaNet layers (model.type qwen3_5: linear and gated full attention mixed by
layer_types; qwen3_5_moe: with MoE layers and a gated shared expert; qwen3_next: the same with a dense MLP
on its mlp_only_layers): the planner's weight, gradient and optimizer bytes and its activation bytes against the
tensors a run holds and autograd saves, with the chunked delta rule (sequences of whole chunks and a padded
one, fp32 and bf16), on one rank and under tensor + sequence parallelism; and Qwen3's per-head q/k norms."""

import pytest
from dist_harness import run_on_ranks
from test_planner import COMMON, _compare, _measure

QWEN3_5 = [
    "model.type=qwen3_5",
    "model.num_layers=4",
    "model.head_dim=16",
    "model.ffn_hidden_size=96",
    "model.linear_num_key_heads=2",
    "model.linear_num_value_heads=4",
    "model.linear_key_head_dim=8",
    "model.linear_value_head_dim=12",
    "model.layer_types=[linear_attention,full_attention,linear_attention,full_attention]",
    "model.max_position_embeddings=128",
    "data.batch_size=2",
    "logging.log_interval=1",
    "optim.grad_accum_steps=2",
    # the chunked delta rule (what training runs) and the fused head loss; the rest the reference operators
    "precision.fused_ops=[vocab_parallel_head_loss,gated_delta_rule]",
    "precision.fp32_ops=[]",
]
QWEN3_5_MOE = [  # every layer an MoE layer with a gated shared expert
    "model.type=qwen3_5_moe",
    *(key for key in QWEN3_5 if not key.startswith(("model.type=", "model.ffn_hidden_size="))),
    "model.num_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_hidden_size=32",
    "model.shared_expert_intermediate_size=48",
]
QWEN3_NEXT = [  # layer 0 a dense MLP, the others MoE layers with the gated shared expert
    "model.type=qwen3_next",
    *(key for key in QWEN3_5_MOE if not key.startswith("model.type=")),
    "model.ffn_hidden_size=96",
    "model.mlp_only_layers=[0]",
]
RUNS_1 = {
    "qwen3 q/k norms fp32": [*COMMON, "model.type=qwen3", "model.head_dim=24", "optim.grad_accum_steps=2"],
    "qwen3_5 fp32 two chunks": [*QWEN3_5, "data.seq_length=128"],
    "qwen3_5 fp32 padded to two chunks": [*QWEN3_5, "data.seq_length=100"],
    "qwen3_5 bf16 selective": [
        *QWEN3_5,
        "data.seq_length=128",
        "model.precision=bf16",
        "model.activation_checkpointing=selective",
    ],
    "qwen3_5_moe fp32": [*QWEN3_5_MOE, "data.seq_length=128"],
    "qwen3_next fp32": [*QWEN3_NEXT, "data.seq_length=128"],
}
RUNS_2 = {
    "qwen3_5 tp2 sp fp32": [
        *QWEN3_5,
        "data.seq_length=128",
        "distributed.tensor_parallel_size=2",
        "distributed.sequence_parallel=true",
    ],
    "qwen3_next tp2 sp fp32": [
        *QWEN3_NEXT,
        "data.seq_length=128",
        "distributed.tensor_parallel_size=2",
        "distributed.sequence_parallel=true",
    ],
    "qwen3_5_moe tp2 sp fp32": [
        *QWEN3_5_MOE,
        "data.seq_length=128",
        "distributed.tensor_parallel_size=2",
        "distributed.sequence_parallel=true",
    ],
}


def test_gated_deltanet_estimates_match_one_rank():
    _compare(RUNS_1, run_on_ranks(_measure, 1, args=(RUNS_1,), timeout=600), 1)


@pytest.mark.extended
def test_gated_deltanet_estimates_match_tp2_with_sequence_parallelism():
    _compare(RUNS_2, run_on_ranks(_measure, 2, args=(RUNS_2,), timeout=600), 2)
