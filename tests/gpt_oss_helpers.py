"""Tiny random gpt-oss checkpoints written by transformers, and attention with sinks written plainly, for the
gpt-oss family tests."""

from __future__ import annotations

import math

import torch

# 4 layers (sliding, full, sliding, full), kv heads divisible by tp 2, heads 24 wide (not hidden / heads),
# a window of 5 keys shorter than the test sequences, 4 experts of top 2, YaRN as gpt-oss publishes it
# (with a factor that changes the frequencies at this head width), and a clamp the activations reach.
SHAPE = {
    "vocab_size": 260,  # the byte tokenizer's 259 ids fit (model.init_from checks the tokenizer)
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 5,
    "max_position_embeddings": 131072,  # 32 x the original 4096: YaRN's factor, as published
    "swiglu_limit": 1.5,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}


def tiny_hf_gpt_oss(path: str, seed: int = 3, **settings) -> str:
    """A tiny gpt-oss written by transformers as a Hugging Face directory, with every parameter drawn at
    random (transformers starts norms at one and biases at zero, which would hide a mix-up) and large
    enough that the clamp of the experts' activation bites."""
    import transformers

    config = transformers.GptOssConfig(**{**SHAPE, "attn_implementation": "eager", **settings})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("sinks") or "bias" in name:
                param.normal_(0.0, 1.0)
            elif "experts" in name:
                param.normal_(0.0, 0.3)
            else:  # attention, embeddings and head: logits of some spread
                param.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


def hf_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits of the directory ``path`` for ``ids``."""
    import transformers

    model = transformers.GptOssForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


def attention_with_sink_column(q, k, v, sinks, keep):
    """Softmax over each row's allowed scores and the head's sink logit, the sink's weight dropped; GQA by
    repeating kv heads. ``keep`` [b, s, s] True where a query sees a key. BSND in and out."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~keep.unsqueeze(1), float("-inf"))
    weights = torch.exp(scores - torch.logaddexp(scores.logsumexp(-1), sinks.view(1, -1, 1)).unsqueeze(-1))
    return torch.einsum("bhqk,bkhd->bqhd", weights, v)


def visible_keys(segments, window):
    """[b, s, s] True where a query sees a key: causal, within its document (``segments`` [b, s]) and, with a
    ``window`` W, among its last W keys."""
    s = segments.shape[1]
    i, j = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
    keep = (j <= i) & (segments.unsqueeze(-1) == segments.unsqueeze(-2))
    return keep & (i - j < window) if window else keep
