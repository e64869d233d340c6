"""DeepSeek-V4's saved activations, for ``megacann-plan`` (the model contract's
:class:`~megacann.models.spec.ActivationFormulas`): the bytes one :class:`DeepseekV4Block` keeps for backward,
per micro-batch of b sequences of s tokens on one rank, counted from what megacann's reference operators
save (``precision.fp32_ops: []``). a = bytes of the weights' dtype; n = ``hc_mult`` streams of width h;
H heads of width d split over t TP ranks (H_t = H / t); r_q = ``q_lora_rank``; ρ = the rotated width.
Tokens: T = b s of the whole sequence, T_l = T / t of them under sequence parallelism (else T); a
context-parallel rank holds 1 / cp of both.

- each of the two hyper-connections, per T_l token: the streams (a n h) and, in a low-precision model,
  their fp32 copy (4 n h), the normalised features (4 n h), 1/rms (4), the mixing logits (4 (2 + n) n),
  pre's and post's sigmoids and pre (12 n), comb's softmax (4 n²), and Sinkhorn's 2 i - 1 divisions of
  ``hc_sinkhorn_iters`` = i, each a numerator and a sum (4 (n² + n)); mixing the block's output back,
  its output, post and comb in the streams' dtype (a (h + n + n²));
- the two RMSNorms, per T_l token: a (h + 1);
- attention, per T token (its input gathered over the sequence): the down projections' input (a h), the
  query's low-rank norm and up projection's input (a (2 r_q + 1)), the per-head query norm (a H_t d + 4
  H_t, and in a low-precision model its fp32 copy and 1/rms cast, 4 H_t d + a H_t), the KV head's norm
  (a (d + 1)), three rotary tables (cos, sin, -sin: 3 a ρ), the grouped output projection's inputs
  (a H_t d + a (o_groups / t) o_lora_rank);
- the core attention (dropped by ``selective`` recompute, which keeps its rotated q and KV head and the
  position ids instead: a (H_t d + d) per token and 8 s; under cp the batch's, 8 b s / cp once a chunk): the reference softmax with sinks, per block of
  queries (sliding layers: one block of s queries over s keys, its mask [s, s]; compressed layers: blocks of
  ``sliding_window`` queries over the keys their window reaches plus every compressed entry, masks per
  sequence), of q queries over k keys: q, k and v expanded to the heads (a b H_t (q + 2 k) d), the
  probabilities over k + 1 columns (a b H_t q (k + 1)) and the mask (b q k bytes);
- a compressor of rate r (W = s // r entries; c = 2 for the overlapping, compressed sparse one): its
  candidates and softmax weights (b W c r d (a + 4), a low-precision model's cast weights a more), the
  entries' norm (a b W (d + 1)) and rotary tables (2 a b W ρ). The indexer's picks save nothing (no_grad);
- the MoE block: :mod:`megacann.planning.moe`'s formulas (router with the ``sqrtsoftplus`` logits, clamped
  SwiGLU experts; hash-routed layers save the same).

``full`` recompute keeps each layer's input streams (a n h per T_l token). The last chunk's hyper-connection
head saves the streams, the normalised features, 1/rms and three n-wide tensors (as a hyper-connection's
collapse), the final norm a (h + 1) per T_l token.

Under context parallelism (all-gather, the only algorithm DeepSeek-V4 runs) a rank holds two chunks of
s / (2 cp) tokens: its queries read the whole sequence's gathered KV head and compressed entries (each
compressor pools the whole gathered sequence: W entries, its input b s h a), per block of queries as above;
each gather keeps an int64 index of the s tokens (8 s). The bytes are those of the rank whose blocks
read the most keys.
"""

from __future__ import annotations

from typing import Optional

from megacann.config import ModelConfig
from megacann.models.deepseek_v4_config import (
    CSA,
    SLIDING,
    rope_head_dim,
    v4_compress_rates,
    v4_layer_types,
    v4_mlp_layer_types,
)
from megacann.models.spec import ActivationFormulas, ActivationShape, MoEStructure

FP32 = 4
SELECTIVE_TERMS = ("core attention", "compressor")  # what selective recompute reruns in backward


def _local_tokens(shape: ActivationShape) -> float:
    """Tokens of one micro-batch the hyper-connections, norms and mixing see on a rank."""
    return shape.micro_batch * shape.seq_length / shape.cp / (shape.tp if shape.sequence_parallel else 1)


def hyper_connection_bytes(m: ModelConfig, tokens: float, a: int) -> float:
    """One :class:`~megacann.layers.HyperConnection` and the mixing of its block's output back."""
    n, h = m.hc_mult, m.hidden_size
    copy = FP32 * n * h if a != FP32 else 0  # the streams' fp32 copy in a low-precision model
    mixing = FP32 * n * h + FP32 + FP32 * (2 + n) * n + 3 * FP32 * n + FP32 * n * n
    sinkhorn = (2 * m.hc_sinkhorn_iters - 1) * FP32 * (n * n + n)
    mix_back = a * (h + n + n * n)
    return tokens * (a * n * h + copy + mixing + sinkhorn + mix_back)


def hyper_head_bytes(m: ModelConfig, tokens: float, a: int) -> float:
    """The :class:`~megacann.layers.HyperHead`: streams, features, 1/rms, logits, sigmoid and weights."""
    n, h = m.hc_mult, m.hidden_size
    copy = FP32 * n * h if a != FP32 else 0
    return tokens * (a * n * h + copy + FP32 * n * h + FP32 + 3 * FP32 * n)


def _attention_block(b: int, heads: int, d: int, queries: int, keys: int, a: int, mask_rows: int) -> float:
    """The reference softmax with sinks over one block: q, k, v expanded to the heads (k and v views of one
    tensor when the rank has one head), the probabilities over ``keys + 1`` columns, the boolean mask of
    ``mask_rows`` rows of keys."""
    kv = 2 * heads * keys if heads > 1 else keys
    return b * a * d * (heads * queries + kv) + b * a * heads * queries * (keys + 1) + mask_rows * keys


def _window_blocks(m: ModelConfig, start: int, count: int, entries: int, b: int, heads: int, a: int) -> float:
    """Queries ``start .. start + count - 1`` in blocks of ``sliding_window``, each over its window's keys
    and every compressed entry (``windowed_attention``)."""
    w, d, total = m.sliding_window, m.head_dim, 0.0
    for lo in range(start, start + count, w):
        hi = min(lo + w, start + count)
        keys = hi - max(0, lo - w + 1) + entries
        total += _attention_block(b, heads, d, hi - lo, keys, a, b * (hi - lo))
    return total


def _core_attention(m: ModelConfig, shape: ActivationShape, kind: str, a: int) -> float:
    """The core attention's saved bytes on a rank (see the module docstring)."""
    b, s, heads, cp = shape.micro_batch, shape.seq_length, m.num_attention_heads // shape.tp, shape.cp
    entries = 0 if kind == SLIDING else s // v4_compress_rates(m)[kind]
    if cp == 1 and kind == SLIDING:  # one call over the whole sequence, its mask [s, s]
        return _attention_block(b, heads, m.head_dim, s, s, a, s)
    if cp == 1:
        return _window_blocks(m, 0, s, entries, b, heads, a)
    chunk = s // (2 * cp)
    per_rank = [
        sum(_window_blocks(m, c * chunk, chunk, entries, b, heads, a) for c in (rank, 2 * cp - 1 - rank))
        for rank in range(cp)
    ]
    return max(per_rank) + 8 * s  # the gather's int64 index of the whole sequence's tokens


def _compressor(m: ModelConfig, shape: ActivationShape, kind: str, a: int) -> float:
    """A compressor pooling the (gathered) sequence: candidates, softmax weights, entries' norm and rotation;
    under context parallelism also its gathered input."""
    b, s, d = shape.micro_batch, shape.seq_length, m.head_dim
    rate = v4_compress_rates(m)[kind]
    width = 2 if kind == CSA else 1
    windows = s // rate
    pooled = b * windows * width * rate * d * (a + FP32 + (a if a != FP32 else 0))
    gathered = b * s * m.hidden_size * a + 8 * s if shape.cp > 1 else 0  # the gathered input and its index
    return pooled + b * windows * a * (d + 1 + 2 * rope_head_dim(m)) + gathered


def v4_layer_kind(m: ModelConfig, layer_id: int) -> str:
    return f"{v4_layer_types(m)[layer_id]} + {v4_mlp_layer_types(m)[layer_id]}"


def v4_layer_activations(m: ModelConfig, shape: ActivationShape, layer_id: int, recompute: str) -> dict[str, float]:
    """Bytes layer ``layer_id`` saves for one micro-batch but its MoE block's, by what saves them
    (``recompute``: none or selective)."""
    a, kind = shape.dtype_bytes, v4_layer_types(m)[layer_id]
    h, d, r_q, heads = m.hidden_size, m.head_dim, m.q_lora_rank, m.num_attention_heads // shape.tp
    local, tokens = _local_tokens(shape), shape.micro_batch * shape.seq_length / shape.cp
    query_norm = a * heads * d + FP32 * heads + (FP32 * heads * d + a * heads if a != FP32 else 0)
    projections = a * (h + 2 * r_q + 1 + d + 1 + heads * d + m.o_groups // shape.tp * m.o_lora_rank)
    terms = {
        "hyper-connections": 2 * hyper_connection_bytes(m, local, a),
        "norms": 2 * local * a * (h + 1),
        "attention projections and norms": tokens * (projections + query_norm),
        "rotary tables": tokens * 3 * a * rope_head_dim(m),
    }
    if recompute == "selective":  # the checkpoint keeps the rotated q and KV head, and one row of positions
        positions = 8 * shape.seq_length if shape.cp == 1 else 0  # made by each layer; under cp the batch's
        terms["core attention inputs"] = tokens * a * (heads * d + d) + positions
        return terms
    terms["core attention"] = _core_attention(m, shape, kind, a)
    if kind != SLIDING:
        terms["compressor"] = _compressor(m, shape, kind, a)
    return terms


def v4_full_recompute(m: ModelConfig, shape: ActivationShape, layer_id: int) -> float:
    """A layer's input streams: what ``full`` recompute keeps."""
    return _local_tokens(shape) * shape.dtype_bytes * m.hc_mult * m.hidden_size


def v4_moe_structure(m: ModelConfig, layer_id: int) -> Optional[MoEStructure]:
    """Every layer's MoE block: top-k routed (or hash-routed: the same bytes) clamped-SwiGLU experts."""
    return MoEStructure(
        moe_layers=(True,) * m.num_layers,
        num_experts=m.num_experts,
        expert_ffn_hidden_size=m.moe_ffn_hidden_size,
        top_k=m.moe_top_k,
        shared_ffn_hidden_size=m.moe_shared_experts * m.moe_ffn_hidden_size,
        capacity_factor=m.moe_capacity_factor,
        normalize_top_k=True,
        clamped_activation=True,
        score_function=m.moe_router,
    )


def v4_head_activations(m: ModelConfig, shape: ActivationShape) -> dict[str, float]:
    """The last chunk's hyper-connection head and final norm."""
    local, a = _local_tokens(shape), shape.dtype_bytes
    return {"hyper-connection head": hyper_head_bytes(m, local, a), "final norm": local * a * (m.hidden_size + 1)}


def v4_shared_activations(m: ModelConfig, shape: ActivationShape, recompute: str) -> dict[str, float]:
    """Under context parallelism with selective recompute, the layers' checkpoints all keep the batch's
    int64 position ids (this rank's split copy): once a chunk."""
    if shape.cp == 1 or recompute != "selective":
        return {}
    return {"position ids (selective recompute)": 8 * shape.micro_batch * shape.seq_length / shape.cp}


V4_ACTIVATIONS = ActivationFormulas(
    kind=v4_layer_kind,
    layer=v4_layer_activations,
    full=v4_full_recompute,
    moe=v4_moe_structure,
    head=v4_head_activations,
    shared=v4_shared_activations,
)
