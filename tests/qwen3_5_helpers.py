"""Tiny random Qwen3.5 checkpoints written by transformers, for the qwen3_5 family tests."""

from __future__ import annotations

from typing import Optional

import torch

# 4 layers (linear, linear, full, linear: a full layer on each pipeline stage would hide a stage that
# cannot hold one, so the second stage has one of each kind), kv heads and linear key heads divisible by
# tp 2, heads 16 wide with RoPE on a quarter of them (4 dims), two value heads per key head.
SHAPE = {
    "vocab_size": 260,  # the byte tokenizer's 259 ids fit (model.init_from checks the tokenizer)
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 64,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    # as the published configurations write them: multimodal rotary sections, equal to the plain rotary on text
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
}


# Qwen3.5-MoE: the same layers, each with 4 experts of top 2 and a shared expert wider than a routed one
MOE_SHAPE = {
    **{k: v for k, v in SHAPE.items() if k != "intermediate_size"},
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}


def hf_classes(moe: bool = False) -> tuple:
    """(config class, causal-LM class) of transformers for Qwen3.5 (``moe``: Qwen3.5-MoE)."""
    import transformers

    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    return getattr(transformers, f"{prefix}TextConfig"), getattr(transformers, f"{prefix}ForCausalLM")


def tiny_hf_qwen3_5(
    path: str, seed: int = 3, moe: bool = False, std: float = 0.1, classes: Optional[tuple] = None, **settings
) -> str:
    """A tiny Qwen3.5 (``moe``: Qwen3.5-MoE) written by transformers as a Hugging Face directory, with every
    parameter drawn at random (transformers starts the norms' offsets at zero and dt_bias at one, which
    would hide a mix-up); the projections, embeddings and experts with spread ``std``. ``classes``: another
    family's (config class, causal-LM class) built from the same shape and ``settings``."""
    config_class, model_class = classes or hf_classes(moe)
    config = config_class(**{**(MOE_SHAPE if moe else SHAPE), "attn_implementation": "eager", **settings})
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5) if "linear_attn" not in name else param.uniform_(0.5, 1.5)
            elif name.endswith("dt_bias"):
                param.normal_(0.0, 1.0)
            elif not name.endswith("A_log"):
                param.normal_(0.0, std)
    model.save_pretrained(path)
    return path


def hf_logits(path: str, ids: torch.Tensor, moe: bool = False, model_class: Optional[type] = None) -> torch.Tensor:
    """transformers' logits of the directory ``path`` for ``ids`` (``model_class``: another family's)."""
    model = (model_class or hf_classes(moe)[1]).from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


def check_hf_round_trips(
    model, hf_dir: str, root, ids: torch.Tensor, expected: torch.Tensor, model_class: type
) -> None:
    """``model`` written back by save_pretrained_hf, and ``hf_dir`` through megacann-convert from-hf then
    to-hf, both give transformers' logits ``expected`` (1e-4) and every tensor of ``hf_dir`` exactly
    (the norms' offsets and any fused projections included); ``root``: a scratch directory."""
    from megacann.convert import main as convert
    from megacann.interop import save_pretrained_hf

    save_pretrained_hf([model], str(root / "back"), model.config)
    assert convert(["from-hf", hf_dir, str(root / "whole")]) == 0
    assert convert(["to-hf", str(root / "whole"), str(root / "converted")]) == 0
    reference_state = model_class.from_pretrained(hf_dir).state_dict()
    for out in ("back", "converted"):
        got = hf_logits(str(root / out), ids, model_class=model_class)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        again = model_class.from_pretrained(str(root / out)).state_dict()
        assert again.keys() == reference_state.keys()
        for name, tensor in reference_state.items():
            torch.testing.assert_close(again[name], tensor, atol=1e-7, rtol=0, msg=(out, name))
