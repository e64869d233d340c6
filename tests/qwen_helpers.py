"""Tiny random Qwen2 / Qwen3 / Qwen3-MoE checkpoints written by transformers, for the Qwen family tests."""

from __future__ import annotations

import torch

# Every family's tiny shape: 4 layers (two per stage at pp 2), kv heads divisible by tp 2. Qwen2 ties its
# embeddings (as its small sizes do); Qwen3's heads are 24 wide, not hidden / heads = 16; Qwen3-MoE has a
# dense layer (mlp_only_layers) among its MoE layers and renormalised top-2 routing.
SHAPE = {
    "vocab_size": 260,  # the byte tokenizer's 259 ids fit (model.init_from checks the tokenizer)
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
FAMILY_SETTINGS = {
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"head_dim": 24},
    "qwen3_moe": {
        "head_dim": 24,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
}
HF_CLASSES = {"qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}


def hf_classes(family: str):
    """(config class, causal-LM class) of transformers for ``family``."""
    import transformers

    prefix = HF_CLASSES[family]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")


def tiny_hf_qwen(path: str, family: str, seed: int = 3, **settings) -> str:
    """A tiny model of ``family`` written by transformers as a Hugging Face directory, with its norms and
    biases randomised (transformers starts them at ones and zeros, which would hide a mix-up)."""
    config_class, model_class = hf_classes(family)
    config = config_class(**{**SHAPE, **FAMILY_SETTINGS[family], "attn_implementation": "eager", **settings})
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def hf_logits(path: str, family: str, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits of the directory ``path`` for ``ids``."""
    model = hf_classes(family)[1].from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits
