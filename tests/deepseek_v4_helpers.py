"""Tiny random DeepSeek-V4 models written by transformers, for the deepseek_v4 family tests."""

from __future__ import annotations

import torch

# 4 layers: every attention kind (sliding, compressed sparse, heavily compressed) and both routings
# (hash, top-k); 4 heads (tp 2), 4 experts (ep 2), 2 residual streams; windows and compression rates
# short enough that a 24-token sequence reaches past the window and closes several compressed entries
SHAPE = {
    "vocab_size": 260,  # the byte tokenizer's 259 ids fit (model.init_from checks the tokenizer)
    "hidden_size": 32,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 16,
    "q_lora_rank": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "hash_moe"],
    "hc_mult": 2,
    "hc_sinkhorn_iters": 3,
    "sliding_window": 8,
    "o_groups": 2,
    "o_lora_rank": 8,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 3,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 256,
    "swiglu_limit": 0.05,  # small enough that the clamps bite on random weights
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def tiny_hf_v4_model(seed: int = 3, **settings):
    """A tiny random ``DeepseekV4ForCausalLM`` (eval mode) whose buffers and zero-started parameters are
    randomised: each token's hash-routed experts two distinct ones, the routing biases, sinks, position
    biases and mixing biases non-zero (transformers starts them at zeros, which would hide a mix-up)."""
    import transformers

    config = transformers.DeepseekV4Config(**{**SHAPE, **settings})
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("tid2eid"):
                ranked = torch.rand(tensor.shape[0], config.n_routed_experts, generator=g).argsort(-1)
                tensor.copy_(ranked[:, : tensor.shape[1]])
            elif name.endswith(("e_score_correction_bias", "sinks", "position_bias", ".base", "hc_base")):
                tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.5)
            elif name.endswith("norm.weight"):
                tensor.copy_(1 + torch.randn(tensor.shape, generator=g) * 0.1)
    return model


def tiny_hf_v4(path: str, seed: int = 3, **settings) -> str:
    """:func:`tiny_hf_v4_model` written to ``path`` by transformers; returns ``path``."""
    tiny_hf_v4_model(seed, **settings).save_pretrained(path)
    return path


def hf_v4_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own logits of the checkpoint at ``path``."""
    import transformers

    model = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits
