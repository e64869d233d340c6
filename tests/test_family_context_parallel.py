"""The newer families under context parallelism train like one process (fp32, relative 1e-5), each with
another cp algorithm: Qwen2 (qkv bias, tied embeddings) by ring, Qwen3 (per-head q/k norms, 24-wide heads)
by Ulysses, Qwen3-MoE (a dense layer among MoE layers, auxiliary loss over the whole sequence) by
all-gather, and Mistral with a sliding window shorter than the sequence by ring. DeepSeek-V3's latent
attention has its own cp tests (tests/test_deepseek_parallel.py)."""

import pytest
from layout_fuzz import Layout, compare

pytestmark = pytest.mark.extended

CP2 = "distributed.context_parallel_size=2"
QWEN3 = ["model.head_dim=24"]
FAMILIES = {
    "qwen2_ring": (["model.type=qwen2", "model.tie_word_embeddings=true"], [CP2]),
    "qwen3_ulysses": (["model.type=qwen3", *QWEN3], [CP2, "distributed.context_parallel_algo=ulysses"]),
    "qwen3_moe_allgather": (
        [
            "model.type=qwen3_moe",
            *QWEN3,
            "model.num_experts=4",
            "model.moe_top_k=2",
            "model.moe_ffn_hidden_size=32",
            "model.mlp_only_layers=[1]",
            "model.moe_aux_loss_coeff=1e-2",
        ],
        [CP2, "distributed.context_parallel_algo=allgather"],
    ),
    "mistral_window_ring": (["model.type=mistral", "model.sliding_window=12"], [CP2]),
}


def test_families_at_cp2_train_like_one_process():
    layouts = [Layout(0, 2, model, parallel, label=name) for name, (model, parallel) in FAMILIES.items()]
    problems = {name: found for name, found in compare(layouts).items() if found}
    assert not problems, problems
