"""Memory formulas of megacann training, in one place: what each device holds, from the recipe alone.

Everything here counts what megacann's own code allocates, checked against measurement
(``tests/test_planner.py``: parameter, gradient and optimizer bytes read from the tensors, activation bytes
from the tensors autograd saves), not textbook figures.

**Parameters and optimizer** (bytes per parameter held on a device; Ψ = that device's parameters):

- weights: 2 (bf16/fp16) or 4 (fp32);
- gradients: 4, always: they accumulate in fp32 buffers (``main_grad``) whatever the weights' dtype;
  ZeRO-2 keeps 4/N after each step but the whole 4 while gradients accumulate, i.e. at the peak unless
  there is one micro-batch per step *and* ``overlap_grad_reduce`` frees each bucket during backward;
- optimizer: fp32 master weights (4, none when the weights are fp32 already) + Adam's two moments (8;
  SGD's momentum 4), divided over the N data-parallel (x context-parallel) ranks with ZeRO-1/2.

With expert parallelism (an MoE family, :mod:`megacann.planning.moe`) N is dp x cp for dense parameters
and dp / ep x cp for expert parameters (the ranks holding the same experts).

So mixed-precision Adam is 2 + 4 + 12 = 18 B/param without ZeRO; the ZeRO paper counts 16 (bf16
gradients); ``unsharded_bytes`` gives both.

Parameters per device follow the layers' sharding: column/row-parallel weights and the vocabulary split
over TP (q and o projections h x n d / t with n heads of width d = ``head_dim``, which may differ from
h / n; q, k, v biases split like their rows), norms (also the per-head q/k norms) and row-parallel biases
replicated, k/v projections replicated when there are fewer kv heads than TP ranks; an MoE layer's
router, shared and routed experts as :mod:`megacann.planning.moe` says; the first pipeline stage holds
the embedding, the last the final norm and the output layer (a copy of the embedding when tied and pp > 1).

**Activations** (bytes autograd saves for backward, per micro-batch of b sequences of s tokens; a = bytes
of the weights' dtype; t = TP size; h hidden, f ffn, k = kv heads x head dim, n = attention heads):
per transformer layer, per token (q = n x head_dim, = h when heads are h / n wide),

- LLaMA: a * [4h + 2 + (2q + 2k + 4f)/t] + 4n/t: two RMSNorms save their normalised input and 1/rms
  (h + 1 each), the q/k/v and gate/up projections save their input (h each), attention saves q, k, v
  after rotary and its output (2q/t + 2k/t) plus a float32 log-sum-exp per head (4n/t), the SwiGLU saves
  the gate|up output (2f/t) and silu(gate) (f/t), the down projection its input (f/t);
- GPT: a * [4h + 4 + (2q + 2k + 2f)/t] + 4n/t: LayerNorms save their input, mean and 1/std, the GELU MLP
  its input and output (2f/t);
- an MoE layer: the norms and attention as above, its feed-forward block as :mod:`megacann.planning.moe`
  says (router, routed token copies, shared experts) instead of the MLP's.

Not counted: the tensors the per-head q/k norms (Qwen3) save.

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
each, s/t tokens with sequence parallelism) until its backward.

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from megacann.accelerator import PRECISION_DTYPES
from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.config.offload_keys import offloaded_layer_ids
from megacann.layers.embedding import pad_vocab_size
from megacann.layers.output import HEAD_LOSS
from megacann.models import DecoderArch, get_model_spec
from megacann.models.sizing import attention_head_dim
from megacann.models.spec import MoEStructure
from megacann.planning.moe import moe_activation_terms, moe_parameters_per_rank

DTYPE_BYTES = {name: dtype.itemsize for name, dtype in PRECISION_DTYPES.items()}
GRAD_BYTES = 4  # fp32 gradient buffers
MASTER_BYTES = 4  # fp32 master copy of low-precision weights
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
SGD_STATE_BYTES = 4  # momentum, fp32
PAPER_BYTES = 16  # the ZeRO paper's mixed-precision Adam: 2 weights + 2 grads + 12 optimizer


@dataclass(frozen=True)
class Layout:
    """A parallel layout and the recompute / micro-batch choices that decide per-device memory."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    zero: int = 0
    recompute: str = "none"  # none | selective | full
    micro_batch: int = 1
    num_microbatches: int = 1  # per step: grad_accum_steps
    sequence_parallel: bool = False
    overlap_grad_reduce: bool = False
    cp: int = 1  # context parallel: each rank holds seq_length / cp tokens of every sequence
    ep: int = 1  # expert parallel, carved out of dp: each rank holds num_experts / ep experts
    offload_optimizer: bool = False  # fp32 masters and optimizer state in host memory (planning.placement)
    offload_layers: tuple[int, ...] = ()  # global ids of the layers whose activations go to host memory
    zero_group: int = 0  # hybrid sharding: ZeRO shards within groups of this many ranks; 0: the whole group

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def zero_shards(self) -> int:
        """Ranks ZeRO shards over: the data-parallel x context-parallel group gradients are reduced over (or
        a hybrid-sharding group of it)."""
        return min(self.zero_group or self.dp * self.cp, self.dp * self.cp)

    @property
    def expert_zero_shards(self) -> int:
        """Ranks ZeRO shards expert parameters over: the expert-data-parallel x cp group (dp / ep x cp)."""
        return min(self.zero_group or self.dp // self.ep * self.cp, self.dp // self.ep * self.cp)

    def describe(self) -> str:
        dp = f"dp {self.dp}" + (f" (ep {self.ep})" if self.ep > 1 else "")
        parts = [f"tp {self.tp}", f"pp {self.pp}" + (f" (vpp {self.vpp})" if self.vpp > 1 else ""), dp]
        if self.cp > 1:
            parts.append(f"cp {self.cp}")
        extra = [f"ZeRO-{self.zero}" if self.zero else "no ZeRO", f"recompute {self.recompute}"]
        if self.sequence_parallel:
            extra.append("SP")
        extra += ["optimizer offload"] if self.offload_optimizer else []
        extra += [f"activation offload of {len(self.offload_layers)} layers"] if self.offload_layers else []
        return (
            " x ".join(parts) + ", " + ", ".join(extra) + f", micro-batch {self.micro_batch} x {self.num_microbatches}"
        )


def layout_of(cfg: MegacannConfig) -> Layout:
    """The layout a (validated) recipe asks for."""
    d = cfg.distributed
    return Layout(
        tp=d.tensor_parallel_size,
        pp=d.pipeline_parallel_size,
        dp=d.data_parallel_size or 1,
        vpp=d.virtual_pipeline_size or 1,
        zero=d.zero_stage,
        recompute=cfg.model.activation_checkpointing,
        micro_batch=cfg.data.batch_size,
        num_microbatches=cfg.optim.grad_accum_steps,
        sequence_parallel=d.sequence_parallel_active,
        overlap_grad_reduce=d.overlap_grad_reduce,
        cp=d.context_parallel_size,
        ep=d.expert_parallel_size,
        offload_optimizer=cfg.optim.offload_optimizer,
        offload_layers=tuple(offloaded_layer_ids(cfg)),
        zero_group=getattr(d, "zero_shard_group_size", None) or 0,  # hybrid sharding, where the recipe has it
    )


# -- parameters ---------------------------------------------------------------------------------------


def _local_kv(m: ModelConfig, tp: int) -> int:
    """Rows of each k/v projection on one TP rank: split when kv heads divide by tp, else replicated."""
    kv = m.kv_heads * attention_head_dim(m)
    return kv // tp if m.kv_heads % tp == 0 else kv


def _kv_read(m: ModelConfig, tp: int) -> int:
    """Rows of k (and of v) one TP rank computes: its share, or with replicated k/v projections the kv heads
    its query heads read."""
    from megacann.layers.attention import kv_heads_for_rank

    head_dim = attention_head_dim(m)
    if m.kv_heads % tp == 0:
        return m.kv_heads * head_dim // tp
    first, end = kv_heads_for_rank(m.num_attention_heads, m.kv_heads, tp, 0)
    return (end - first) * head_dim


def architecture(m: ModelConfig) -> DecoderArch:
    """The decoder architecture of the recipe's model family (the formulas below are a decoder's)."""
    arch = get_model_spec(m.type).architecture
    if not isinstance(arch, DecoderArch):
        raise ConfigError(
            f"model.type {m.type!r}: the memory planner's formulas are a decoder's (llama, gpt); this family "
            "describes no DecoderArch in its ModelSpec.architecture"
        )
    return arch


def moe_structure(m: ModelConfig) -> Optional[MoEStructure]:
    """The MoE layers of the recipe's family (its ``ModelSpec.moe_structure``), None for a dense family."""
    describe = get_model_spec(m.type).moe_structure
    return describe(m) if describe is not None else None


def is_moe_layer(m: ModelConfig, layer_id: int) -> bool:
    moe = moe_structure(m)
    return moe is not None and moe.moe_layers[layer_id]


def query_width(m: ModelConfig) -> int:
    """Rows of the q projection (columns of the output projection): heads x head_dim."""
    return m.num_attention_heads * attention_head_dim(m)


def attention_parameters_per_rank(m: ModelConfig, tp: int) -> int:
    """q, k, v and output projections of one layer on one TP rank, with their biases and q/k norms."""
    arch = architecture(m)
    h, q, kv = m.hidden_size, query_width(m) // tp, _local_kv(m, tp)
    qkv_bias = m.use_bias if arch.qkv_bias is None else arch.qkv_bias
    total = h * q + 2 * kv * h + q * h
    total += (q + 2 * kv) if qkv_bias else 0  # split like their rows
    total += h if m.use_bias else 0  # o_proj's, replicated
    return total + (2 * attention_head_dim(m) if arch.qk_norm else 0)  # per-head norms, whole on every rank


def layer_parameters_per_rank(m: ModelConfig, tp: int, layer_id: int = 0, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of transformer layer ``layer_id`` held by one TP rank (of one
    expert-parallel rank): attention, two norms and the MLP, or an MoE layer's router, shared and routed
    experts (the only expert parameters)."""
    arch = architecture(m)
    h, f = m.hidden_size, m.ffn_size
    dense = attention_parameters_per_rank(m, tp) + 2 * arch.norm_parameters_per_width * h
    moe = moe_structure(m)
    if moe is not None and moe.moe_layers[layer_id]:
        router_shared, experts = moe_parameters_per_rank(h, tp, ep, moe)
        return dense + router_shared, experts
    mats = arch.mlp_matrices  # gate (if gated), up, down
    mlp = mats * h * f // tp + (((mats - 1) * f // tp + h) if m.use_bias else 0)
    return dense + mlp, 0


def padded_vocab(cfg: MegacannConfig, tp: int) -> int:
    return pad_vocab_size(cfg.model.vocab_size, tp, cfg.model.make_vocab_size_divisible_by)


def chunk_parameters_per_rank(
    cfg: MegacannConfig, tp: int, layer_ids: Sequence[int], first: bool, last: bool, pp: int, ep: int = 1
) -> tuple[int, int]:
    """(all, expert) parameters of one model chunk on one TP rank: its layers, plus the embedding (first
    chunk of the model) and the final norm and output layer (last chunk)."""
    m = cfg.model
    h, vocab = m.hidden_size, padded_vocab(cfg, tp) // tp
    per_layer = [layer_parameters_per_rank(m, tp, i, ep) for i in layer_ids]
    experts = sum(e for _, e in per_layer)
    total = sum(d for d, _ in per_layer) + experts
    arch = architecture(m)
    if first:
        total += vocab * h + (m.max_position_embeddings * h if arch.position_embedding == "learned" else 0)
    if last:
        total += arch.norm_parameters_per_width * h
        if not m.tie_word_embeddings or pp > 1:  # tied with one stage: the embedding is the output layer
            total += vocab * h
    return total, experts


def fused_head_loss(cfg: MegacannConfig) -> bool:
    """Whether the recipe lets the output head use the fused, chunked loss (precision.fused_ops)."""
    fused = cfg.precision.fused_ops
    return fused is True or (not isinstance(fused, bool) and HEAD_LOSS in fused)


def weight_bytes_per_param(cfg: MegacannConfig) -> int:
    return DTYPE_BYTES[cfg.model.precision]


def optimizer_bytes_per_param(cfg: MegacannConfig) -> int:
    """Master weights and optimizer state per parameter, before ZeRO sharding."""
    master = 0 if cfg.model.precision == "fp32" else MASTER_BYTES
    state = SGD_STATE_BYTES if cfg.optim.name == "sgd" else ADAM_STATE_BYTES
    return master + state


def static_bytes(cfg: MegacannConfig, layout: Layout, params: int, expert_params: int = 0) -> dict[str, float]:
    """{"weights", "grads", "optimizer"}: bytes at the peak for ``params`` parameters on one device, of
    which ``expert_params`` are experts (ZeRO shards those over dp / ep x cp ranks, the rest over dp x cp)."""
    dense = params - expert_params
    sharded = dense / layout.zero_shards + expert_params / layout.expert_zero_shards  # ZeRO's share
    grads_sharded = layout.zero >= 2 and layout.num_microbatches == 1 and layout.overlap_grad_reduce
    grads = GRAD_BYTES * (sharded if grads_sharded else params)
    optimizer = optimizer_bytes_per_param(cfg) * (sharded if layout.zero else params)
    return {"weights": weight_bytes_per_param(cfg) * params, "grads": grads, "optimizer": optimizer}


def unsharded_bytes(cfg: MegacannConfig, params: int) -> dict[str, float]:
    """Weights, gradients and optimizer state of ``params`` parameters on one device, without any sharding,
    as megacann holds them and as the ZeRO paper counts them (16 B/param)."""
    return {
        "weights": weight_bytes_per_param(cfg) * params,
        "grads": GRAD_BYTES * params,
        "optimizer": optimizer_bytes_per_param(cfg) * params,
        "paper_total": PAPER_BYTES * params,
    }


# -- activations --------------------------------------------------------------------------------------


def tokens_per_rank(cfg: MegacannConfig, layout: Layout) -> float:
    """Tokens of one micro-batch a rank's layers hold: b x s, divided by cp under context parallelism."""
    return layout.micro_batch * cfg.data.seq_length / layout.cp


def layer_activation_terms(cfg: MegacannConfig, layout: Layout, moe_layer: bool = False) -> dict[str, float]:
    """Bytes one transformer layer (``moe_layer``: an MoE layer) saves for one micro-batch, by what saves
    them (recompute: none)."""
    m = cfg.model
    a, t = DTYPE_BYTES[m.precision], layout.tp
    h, f, kv, q = m.hidden_size, m.ffn_size, _kv_read(m, t), query_width(m)
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
    if moe_layer:  # the router reads the MLP's input: its own term counts it
        terms["projection inputs"] = tokens * a * h
        del terms["mlp"]
        terms.update(moe_activation_terms(tokens, a, h, t, moe_structure(m)))
    if layout.cp > 1 and cfg.distributed.context_parallel_algo == "ulysses":
        terms[ULYSSES_TERM] = ulysses_extra_bytes(cfg, layout, tokens)
    return terms


ULYSSES_TERM = "attention: Ulysses' head-sharded copies"


def ulysses_extra_bytes(cfg: MegacannConfig, layout: Layout, tokens: float) -> float:
    """What Ulysses saves beyond ring attention: the attention output both before and after the all-to-all
    back (h/t per token more), replicated kv heads when there are fewer than cp, and the two int64
    position indices of the whole sequence that reorder the exchanged tokens."""
    from megacann.layers.context_parallel import ulysses_kv_repeat

    m, t = cfg.model, layout.tp
    a, kv, head_dim = DTYPE_BYTES[m.precision], _kv_read(m, t), attention_head_dim(m)
    repeat = ulysses_kv_repeat(m.num_attention_heads // t, kv // head_dim, layout.cp)
    return tokens * a * (query_width(m) // t + 2 * kv * (repeat - 1)) + 2 * 8 * cfg.data.seq_length


def layer_activation_bytes(
    cfg: MegacannConfig, layout: Layout, recompute: str = "none", moe_layer: bool = False
) -> float:
    """Bytes one layer (``moe_layer``: an MoE layer) keeps between its forward and backward for one
    micro-batch."""
    terms = layer_activation_terms(cfg, layout, moe_layer)
    if recompute == "full":
        tokens = tokens_per_rank(cfg, layout)
        return (
            tokens
            * DTYPE_BYTES[cfg.model.precision]
            * cfg.model.hidden_size
            / (layout.tp if layout.sequence_parallel else 1)
        )
    if recompute == "selective":  # the core attention (and Ulysses' exchanges) rerun in backward
        terms = {k: v for k, v in terms.items() if k not in ("attention log-sum-exp", ULYSSES_TERM)}
    return sum(terms.values())


def chunk_extra_terms(
    cfg: MegacannConfig, layout: Layout, first: bool, last: bool, has_layers: bool
) -> dict[str, float]:
    """Bytes a model chunk saves besides its layers, for one micro-batch."""
    m = cfg.model
    a, t = DTYPE_BYTES[m.precision], layout.tp
    tokens = tokens_per_rank(cfg, layout)
    s = cfg.data.seq_length / layout.cp
    terms: dict[str, float] = {}
    arch = architecture(m)
    learned = arch.position_embedding == "learned"
    if first:
        # int64 ids (this shard's, under TP, with a bool mask of the ids outside it), + learned positions' ids
        # (one row 0..s-1 shared by the batch; under cp the split copy of every sample's share)
        positions = (s if layout.cp == 1 else tokens) * 8
        terms["token ids"] = tokens * (8 + (t > 1)) + (positions if learned else 0)
    if has_layers and arch.position_embedding == "rope":
        terms["rotary tables"] = tokens * 2 * attention_head_dim(m) * a
    if last:
        stats = 2 if arch.normalization == "layernorm" else 1
        norm = tokens * a * (m.hidden_size + stats) / (t if layout.sequence_parallel else 1)
        terms["final norm + output input"] = norm + tokens * a * m.hidden_size
        if fused_head_loss(cfg):  # chunked: the targets (int64) and a float32 log-sum-exp per token
            terms["loss (targets, log-sum-exp)"] = tokens * 12
        else:
            terms["loss (fp32 exponentials)"] = tokens * (4 * padded_vocab(cfg, t) // t + 18)
    return terms


def pipeline_buffer_bytes(cfg: MegacannConfig, layout: Layout, first: bool, last: bool) -> float:
    """What the pipeline executor holds per in-flight micro-batch of a chunk: the received input (not on
    the model's first chunk) and the output to back-propagate (not on the last)."""
    tokens = tokens_per_rank(cfg, layout) / (layout.tp if layout.sequence_parallel else 1)
    per = tokens * cfg.model.hidden_size * DTYPE_BYTES[cfg.model.precision]
    return per * ((not first) + (not last))
