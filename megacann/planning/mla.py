"""Memory formulas of multi-head latent attention (:class:`megacann.layers.LatentAttention`; a family whose
``DecoderArch.latent_attention`` is set, reading its ``q_lora_rank``, ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim`` and ``v_head_dim`` keys).

**Parameters** of one layer's attention on one TP rank (t = TP size, n heads, h hidden, r_q / r_kv the q and
kv latents, d_qk = nope + rope, d_v the value width): the down-projections and their norms whole on every
rank (h r_q + r_q, h (r_kv + rope) + r_kv), the up-projections split over heads (r_q n d_qk / t, or
h n d_qk / t without a q latent; r_kv n (nope + d_v) / t) and the output projection n d_v h / t.

**Activations** per token and micro-batch (a = bytes of the weights' dtype; the latents cover the whole
sequence on every TP rank, also under sequence parallelism): the q latent's norm saves its input and
1/rms and q_b_proj its normed input (a (2 r_q + 1)), likewise the kv latent (a (2 r_kv + 1)); the core
attention runs on heads padded to one width W = max(d_qk, d_v) and saves q, k, v and its output
(4 a n W / t) plus a float32 log-sum-exp per head; o_proj saves its input (a n d_v / t). RoPE saves
nothing (its tables carry no gradient); the rotary tables are of width ``qk_rope_head_dim``.

**DeepSeek-V3.2's lightning indexer** (``DecoderArch.sparse_indexer``; ``index_n_heads`` n_I heads of
``index_head_dim`` d_I): its parameters (wq_b, wk, k_norm, weights_proj) whole on every TP rank, and per
token of the whole sequence on every TP rank, what it saves as megacann computes it (the indexer loss on,
sparse attention): its key before k_norm, k_norm's mean and 1/std and the rotate-half tables re-laid twice
(a (d_I + 2 + 4 rope)), its fp32 queries, head weights and keys (4 n_I (d_I + 1) + 4 d_I); per token and key
of the s keys, the ReLU'd per-head scores (4 n_I: the score product never repeats the keys per query), the
sparse attention's mask of the chosen keys (a), the indexer loss's two masks (2 bytes) and its fp32
log-probabilities and target (8). With ``indexer_loss_coeff`` 0 the indexer builds no graph: the mask alone.
In the warm-up (``indexer_warmup``: dense attention, every weight but the indexers' frozen) the indexer's
terms without the mask, plus its own inputs (a (h + r_q)), are all a layer saves, and the indexers' parameters
alone have gradients and optimizer states (:mod:`megacann.planning.estimate`). Measured against runs in
tests/test_planner_indexer.py.
"""

from __future__ import annotations

from megacann.config import ModelConfig
from megacann.models.deepseek_v32 import indexer_parameters

__all__ = [
    "indexer_activation_terms",
    "indexer_parameters",
    "latent_attention_activation_terms",
    "latent_attention_parameters_per_rank",
]


def padded_head_width(m: ModelConfig) -> int:
    """The head width the core attention runs on: q/k and v padded to the wider."""
    return max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)


def latent_attention_parameters_per_rank(m: ModelConfig, tp: int) -> int:
    """One layer's latent attention on one TP rank (see the module docstring)."""
    h, heads = m.hidden_size, m.num_attention_heads // tp
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = h * heads * qk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank * (1 + heads * qk)
    kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * (1 + heads * (m.qk_nope_head_dim + m.v_head_dim))
    return q + kv + heads * m.v_head_dim * h


def latent_attention_activation_terms(m: ModelConfig, tokens: float, a: int, tp: int) -> dict[str, float]:
    """Bytes one layer's latent attention saves for ``tokens`` tokens (beside the projection input)."""
    heads = m.num_attention_heads // tp
    latents = 2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank
    norms = (m.q_lora_rank is not None) + 1  # each latent norm's 1/rms
    return {
        "attention latents": tokens * a * (latents + norms),
        "attention q k v out": tokens * a * (4 * heads * padded_head_width(m) + heads * m.v_head_dim),
        "attention log-sum-exp": tokens * 4 * heads,
    }


def indexer_activation_terms(m: ModelConfig, tokens: float, s: int, a: int) -> dict[str, float]:
    """Bytes a lightning indexer saves for one micro-batch of ``tokens`` tokens (every TP rank: the whole
    sequence; under context parallelism the rank's share, not measured) scoring ``s`` keys each (see the
    module docstring)."""
    sparse = not m.indexer_warmup and m.index_topk < s  # the attention reads a mask of the chosen keys
    if m.indexer_loss_coeff == 0:  # the indexer only chooses (no graph): the attention keeps the top-k mask
        return {"indexer top-k mask": tokens * s * a} if sparse else {}
    d, n, rope = m.index_head_dim, m.index_n_heads, m.qk_rope_head_dim
    terms = {
        "indexer keys and queries": tokens * (a * (d + 2 + 4 * rope) + 4 * n * (d + 1) + 4 * d),
        "indexer scores": tokens * s * 4 * n,
        "indexer selection and loss": tokens * s * (a * sparse + 2 + 8),
    }
    if m.indexer_warmup:  # the rest of the model frozen: the indexer's own inputs are saved for it alone
        terms["indexer inputs"] = tokens * a * (m.hidden_size + m.q_lora_rank)
    return terms
