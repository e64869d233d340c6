"""Tiny random DeepSeek-V3 checkpoints written by transformers, for the deepseek_v3 family tests."""

from __future__ import annotations

import torch

# 4 layers (two per stage at pp 2; layer 0 dense), 4 heads (tp 2, cp 2 Ulysses), 8 experts in 4 groups
# (a token picks 2 among the best 2 groups; ep 2), value heads (12) narrower than q/k heads (16 + 8)
SHAPE = {
    "vocab_size": 260,  # the byte tokenizer's 259 ids fit (model.init_from checks the tokenizer)
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "kv_lora_rank": 24,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "num_mtp_layers": 0,
}
# "plain": one q_proj, rotate-half RoPE; "yarn": low-rank q, interleaved RoPE, YaRN scaling whose
# mscale and mscale_all_dim differ (so both the tables and the softmax scale move)
VARIANTS = {
    "plain": {"q_lora_rank": None, "rope_interleave": False},
    "yarn": {
        "q_lora_rank": 32,
        "rope_interleave": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.7,
        },
    },
}


def tiny_hf_deepseek(path: str, variant: str = "yarn", seed: int = 3, **settings) -> str:
    """A tiny DeepseekV3ForCausalLM written by transformers, its norms and routing biases randomised
    (transformers starts them at ones and zeros, which would hide a mix-up)."""
    import transformers

    config = transformers.DeepseekV3Config(**{**SHAPE, **VARIANTS[variant], **settings})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    model.save_pretrained(path)
    return path


def hf_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits of the directory ``path`` for ``ids``."""
    import transformers

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


def tiny_deepseek_with_mtp(path: str):
    """A tiny DeepSeek-V3 ("yarn" variant) with one multi-token prediction depth, built and drawn by megacann
    (transformers builds no MTP module), its norms and routing biases randomised; written to ``path`` as a
    Hugging Face directory (the depth as decoder layer 4). Returns the model."""
    import json
    import os

    from megacann.config import MegacannConfig
    from megacann.interop.hf import save_pretrained_hf
    from megacann.models import ChunkPlacement, get_model_spec, prepare_model_config

    os.makedirs(path, exist_ok=True)
    config = os.path.join(path, "config.json")
    with open(config, "w") as f:
        json.dump({**SHAPE, **VARIANTS["yarn"], "model_type": "deepseek_v3", "num_mtp_layers": 1}, f)
    spec = get_model_spec("deepseek_v3")
    cfg = MegacannConfig(model=spec.hf.config_from_hf(config))
    prepare_model_config(cfg, spec)
    model = spec.build(cfg, ChunkPlacement(tuple(range(SHAPE["num_hidden_layers"])))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("expert_bias"):
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(param.numel()))
    save_pretrained_hf([model], path, model.config)
    return model
