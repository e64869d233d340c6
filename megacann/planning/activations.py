"""Activation memory of megacann training: the bytes autograd saves for backward, per micro-batch of b sequences of s
tokens; a = bytes of the weights' dtype; t = TP size; h hidden, f ffn, k = kv heads x head dim, n = attention
heads); per transformer layer, per token (q = n x head_dim, = h when heads are h / n wide),

- LLaMA: a * [4h + 2 + (2q + 2k + 4f)/t] + 4n/t: two RMSNorms save their normalised input and 1/rms
  (h + 1 each), the q/k/v and gate/up projections save their input (h each), attention saves q, k, v
  after rotary and its output (2q/t + 2k/t) plus a float32 log-sum-exp per head (4n/t), the SwiGLU saves
  the gate|up output (2f/t) and silu(gate) (f/t), the down projection its input (f/t);
- GPT: a * [4h + 4 + (2q + 2k + 2f)/t] + 4n/t: LayerNorms save their input, mean and 1/std, the GELU MLP
  its input and output (2f/t);
- an MoE layer: the norms and attention as above, its feed-forward block as :mod:`megacann.planning.moe`
  says (router, routed token copies, shared experts) instead of the MLP's.

Per-head q/k norms (Qwen3, Qwen3.5) add their input and 1/rms (a (q + n)/t + a (k + kv heads) per token); an
output gate (Qwen3.5) its sigmoid and the gated output o_proj reads (2aq/t); partial RoPE makes the rotary
tables the rotated width; a Gated DeltaNet layer (:mod:`megacann.planning.gated_deltanet`) saves its own
terms instead of attention's q, k, v, output and log-sum-exp, and a chunk of DeltaNet layers only no rotary
tables. Latent attention (DeepSeek-V3) replaces the q, k, v
terms by those of :mod:`megacann.planning.mla`, which also has DeepSeek-V3.2's lightning indexer's. Attention
with sinks (gpt-oss) keeps the reference softmax's probabilities over s + 1 columns and its mask, on k and v
repeated to the query heads, instead of the log-sum-exp (:func:`sink_attention_terms`).

Sequence parallelism divides only the norms' part by t: the column-parallel projections save the input
gathered over the sequence (the whole s). ``selective`` recompute drops the log-sum-exp (the attention
core is recomputed; with flash-style attention it holds nothing else); ``full`` keeps only each layer's
input (h, or h/t with sequence parallelism) and recomputes one layer at a time in backward (one layer's
full activations at the peak). Also saved: token ids (8 per token on the first stage, 9 under TP: the
shard's ids and a mask of the others), the rotary tables of each model chunk (2 x head_dim x a per token),
the last stage's final norm and output-layer input and the vocabulary-parallel loss's float32
exponentials (4 x padded vocab / t + 18 per token), or with the fused head loss (``precision.fused_ops``)
only the targets and a log-sum-exp (12 per token).

The layer terms are those of the PyTorch reference operators with ``precision.fp32_ops: []``. Other kernels
save other tensors: on CPU (tiny LLaMA, 4 layers), megacann's C++ kernels saved 13% less than these formulas in fp32, and in bf16
the default ``fp32_ops: [rms_norm]`` (fp32 copies for the norms) 14% more (tests/test_planner.py measures
the reference exactly; the figures above come from the same measurement with the defaults).
The pipeline executor keeps each in-flight micro-batch's received input and its output (h x a per token
each, s/t tokens with sequence parallelism) until its backward. Under the split-backward schedules (zb1p,
zbv, dualpipev) that is B, which frees all but what W needs (the deferred products' inputs and output
gradients, B's parameter gradients, the received gradient and the output): counted from B to W by
:mod:`megacann.planning.deferred`, not here.

Context parallelism divides every per-token count by cp: a rank holds s/cp tokens of every sequence
through the whole model, and ring / all-gather attention save the same q, k, v, output and log-sum-exp for
the rank's own tokens; Ulysses also keeps the attention output from before its all-to-all back (h/t
per token), replicated kv heads when there are fewer than cp, and two position indices. ZeRO shards over the
data-parallel x context-parallel group (dp x cp ranks), the group gradients are summed over. Not counted:
the attention's transient buffers under cp (fp32 block copies and a score tile; all-gather: the whole
sequence's keys and values during the layer). Not counted either: attention masks of packed
documents (``reset_attention_mask`` materialises s x s scores), dropout masks, temporary buffers of a
single op, communication buffers, the allocator's fragmentation and the device runtime itself.
"""

from __future__ import annotations

from megacann.config import MegacannConfig, ModelConfig
from megacann.models.sizing import attention_head_dim
from megacann.planning import mla
from megacann.planning.formulas import (
    DTYPE_BYTES,
    Layout,
    architecture,
    fused_head_loss,
    moe_structure,
    padded_vocab,
    query_width,
)
from megacann.planning.gated_deltanet import gated_deltanet_activation_terms
from megacann.planning.moe import moe_activation_terms


def kv_read_width(m: ModelConfig, tp: int) -> int:
    """Rows of k (and of v) one TP rank computes: its share, or with replicated k/v projections the kv heads
    its query heads read."""
    from megacann.layers.attention import kv_heads_for_rank

    head_dim = attention_head_dim(m)
    if m.kv_heads % tp == 0:
        return m.kv_heads * head_dim // tp
    first, end = kv_heads_for_rank(m.num_attention_heads, m.kv_heads, tp, 0)
    return (end - first) * head_dim


def tokens_per_rank(cfg: MegacannConfig, layout: Layout) -> float:
    """Tokens of one micro-batch a rank's layers hold: b x s, divided by cp under context parallelism."""
    return layout.micro_batch * cfg.data.seq_length / layout.cp


def layer_activation_terms(
    cfg: MegacannConfig, layout: Layout, moe_layer: bool = False, linear_layer: bool = False
) -> dict[str, float]:
    """Bytes one transformer layer (``moe_layer``: an MoE layer; ``linear_layer``: a Gated DeltaNet's) saves
    for one micro-batch, by what saves them (recompute: none)."""
    m = cfg.model
    a, t = DTYPE_BYTES[m.precision], layout.tp
    h, f, kv, q = m.hidden_size, m.ffn_size, kv_read_width(m, t), query_width(m)
    tokens = tokens_per_rank(cfg, layout)
    norm_share = t if layout.sequence_parallel else 1
    arch = architecture(m)
    stats = 2 if arch.normalization == "layernorm" else 1  # LayerNorm: mean and 1/std; RMSNorm: 1/rms
    mlp = (4 if arch.mlp_matrices == 3 else 2) * f // t  # gate and up (and their product), or up
    terms = {
        "norms": tokens * a * 2 * (h + stats) / norm_share,
        "projection inputs": tokens * a * 2 * h,
        "attention q k v out": tokens * a * (2 * q // t + 2 * kv),
        "attention log-sum-exp": tokens * 4 * (m.num_attention_heads // t),
        "mlp": tokens * a * mlp,
    }
    if arch.latent_attention:
        del terms["attention q k v out"]
        terms.update(mla.latent_attention_activation_terms(m, tokens, a, t))
    if arch.sparse_indexer:  # each query scores every key of the sequence (all-gathered under cp)
        indexer = mla.indexer_activation_terms(m, tokens, cfg.data.seq_length, a)
        if m.indexer_warmup:  # every weight but the indexers' frozen: nothing else saves
            return indexer
        terms.update(indexer)
    if arch.attention_sinks:  # the reference's softmax over the keys and the sink column, kv heads expanded
        del terms["attention log-sum-exp"]
        terms.update(sink_attention_terms(m, tokens, cfg.data.seq_length // layout.cp, a, t, kv))
    if linear_layer:
        del terms["attention q k v out"], terms["attention log-sum-exp"]
        seq = cfg.data.seq_length // layout.cp
        terms.update(gated_deltanet_activation_terms(m, layout.micro_batch, seq, a, t))
    else:
        terms.update(attention_extra_terms(m, tokens, a, t, kv))
    if moe_layer:  # the router reads the MLP's input: its own term counts it
        terms["projection inputs"] = tokens * a * h
        del terms["mlp"]
        terms.update(moe_activation_terms(tokens, a, h, t, moe_structure(m)))
    if layout.cp > 1 and cfg.distributed.context_parallel_algo == "ulysses":
        terms[ULYSSES_TERM] = ulysses_extra_bytes(cfg, layout, tokens)
    return terms


ULYSSES_TERM = "attention: Ulysses' head-sharded copies"
SINK_TERMS = ("attention sink probabilities", "attention expanded kv heads")


def sink_attention_terms(m: ModelConfig, tokens: float, s: int, a: int, t: int, kv: int) -> dict[str, float]:
    """What attention with sinks (gpt-oss) saves beyond q, k, v and the output: the reference computes the
    softmax over each query's s keys and its head's sink column (the probabilities, a (s + 1) per head and
    token, and the boolean [s, s] mask), on k and v repeated to the query heads."""
    heads, q = m.num_attention_heads // t, query_width(m) // t
    return {
        SINK_TERMS[0]: tokens * a * heads * (s + 1) + s * s,
        SINK_TERMS[1]: tokens * a * 2 * (q - kv),
    }


def attention_extra_terms(m: ModelConfig, tokens: float, a: int, t: int, kv: int) -> dict[str, float]:
    """What the optional parts of softmax attention save: the per-head q/k norms (their input and 1/rms),
    an output gate (its sigmoid and the gated output o_proj reads)."""
    arch, head_dim, heads = architecture(m), attention_head_dim(m), m.num_attention_heads // t
    terms = {}
    if arch.qk_norm:
        terms["attention q/k norms"] = tokens * a * (query_width(m) // t + heads + kv + kv // head_dim)
    if arch.attention_output_gate:
        terms["attention output gate"] = tokens * a * 2 * query_width(m) // t
    return terms


def ulysses_extra_bytes(cfg: MegacannConfig, layout: Layout, tokens: float) -> float:
    """What Ulysses saves beyond ring attention: the attention output both before and after the all-to-all
    back (h/t per token more), replicated kv heads when there are fewer than cp, and the two int64
    position indices of the whole sequence that reorder the exchanged tokens."""
    from megacann.layers.context_parallel import ulysses_kv_repeat

    m, t = cfg.model, layout.tp
    a, kv, head_dim = DTYPE_BYTES[m.precision], kv_read_width(m, t), attention_head_dim(m)
    repeat = ulysses_kv_repeat(m.num_attention_heads // t, kv // head_dim, layout.cp)
    return tokens * a * (query_width(m) // t + 2 * kv * (repeat - 1)) + 2 * 8 * cfg.data.seq_length


def layer_activation_bytes(
    cfg: MegacannConfig, layout: Layout, recompute: str = "none", moe_layer: bool = False, linear_layer: bool = False
) -> float:
    """Bytes one layer (``moe_layer``: an MoE layer; ``linear_layer``: a Gated DeltaNet's) keeps between
    its forward and backward for one micro-batch."""
    terms = layer_activation_terms(cfg, layout, moe_layer, linear_layer)
    if recompute == "full":
        tokens = tokens_per_rank(cfg, layout)
        return (
            tokens
            * DTYPE_BYTES[cfg.model.precision]
            * cfg.model.hidden_size
            / (layout.tp if layout.sequence_parallel else 1)
        )
    if recompute == "selective":  # the core attention (and Ulysses' exchanges) rerun in backward
        terms = {k: v for k, v in terms.items() if k not in ("attention log-sum-exp", ULYSSES_TERM, *SINK_TERMS)}
    return sum(terms.values())


def chunk_extra_terms(
    cfg: MegacannConfig, layout: Layout, first: bool, last: bool, has_layers: bool
) -> dict[str, float]:
    """Bytes a model chunk saves besides its layers, for one micro-batch (``has_layers``: layers that read
    the rotary tables, i.e. other than Gated DeltaNet)."""
    m = cfg.model
    a, t = DTYPE_BYTES[m.precision], layout.tp
    tokens = tokens_per_rank(cfg, layout)
    s = cfg.data.seq_length / layout.cp
    terms: dict[str, float] = {}
    arch = architecture(m)
    if arch.sparse_indexer and m.indexer_warmup:  # only the indexers train, and they read detached inputs
        return terms
    learned = arch.position_embedding == "learned"
    if first:
        # int64 ids (this shard's, under TP, with a bool mask of the ids outside it), + learned positions' ids
        # (one row 0..s-1 shared by the batch; under cp the split copy of every sample's share)
        positions = (s if layout.cp == 1 else tokens) * 8
        terms["token ids"] = token_id_bytes(cfg, layout) + (positions if learned else 0)
    if has_layers and arch.position_embedding == "rope":
        width = m.qk_rope_head_dim if arch.latent_attention else attention_head_dim(m)
        width = int(width * m.partial_rotary_factor) if arch.partial_rotary else width
        terms["rotary tables"] = tokens * 2 * width * a
    if last:
        stats = 2 if arch.normalization == "layernorm" else 1
        norm = tokens * a * (m.hidden_size + stats) / (t if layout.sequence_parallel else 1)
        output = output_layer_terms(cfg, layout)
        terms["final norm + output input"] = norm + output.pop(OUTPUT_INPUT)
        terms.update(output)
    return terms


OUTPUT_INPUT = "output layer input"


def token_id_bytes(cfg: MegacannConfig, layout: Layout) -> float:
    """The first chunk's int64 token ids (under TP: this shard's, with a bool mask of the ids outside it)."""
    return tokens_per_rank(cfg, layout) * (8 + (layout.tp > 1))


def output_layer_terms(cfg: MegacannConfig, layout: Layout) -> dict[str, float]:
    """What the output layer and the loss save: the layer's input (the whole sequence's tokens under
    sequence parallelism), and the fused loss's targets and log-sum-exp or the vocabulary-parallel loss's
    float32 exponentials."""
    t, tokens = layout.tp, tokens_per_rank(cfg, layout)
    terms = {OUTPUT_INPUT: tokens * DTYPE_BYTES[cfg.model.precision] * cfg.model.hidden_size}
    if fused_head_loss(cfg):  # chunked: the targets (int64) and a float32 log-sum-exp per token
        terms["loss (targets, log-sum-exp)"] = tokens * 12
    else:
        terms["loss (fp32 exponentials)"] = tokens * (4 * padded_vocab(cfg, t) // t + 18)
    return terms


def boundary_tensor_bytes(cfg: MegacannConfig, layout: Layout) -> float:
    """One micro-batch's tensor between pipeline stages (an activation or its gradient): h x a per token,
    s/t tokens with sequence parallelism."""
    tokens = tokens_per_rank(cfg, layout) / (layout.tp if layout.sequence_parallel else 1)
    return tokens * cfg.model.hidden_size * DTYPE_BYTES[cfg.model.precision]


def pipeline_buffer_bytes(cfg: MegacannConfig, layout: Layout, first: bool, last: bool) -> float:
    """What the pipeline executor holds per in-flight micro-batch of a chunk: the received input (not on
    the model's first chunk) and the output to back-propagate (not on the last)."""
    return boundary_tensor_bytes(cfg, layout) * ((not first) + (not last))
