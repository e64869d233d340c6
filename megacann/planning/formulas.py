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

Activations: :mod:`megacann.planning.activations`.
"""

from __future__ import annotations

import copy
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
from megacann.planning import mla
from megacann.planning.gated_deltanet import gated_deltanet_parameters_per_rank
from megacann.planning.moe import moe_parameters_per_rank

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
    schedule: Optional[str] = None  # distributed.pipeline_schedule; None: 1F1B, or interleaved when vpp > 1

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
        pipeline = [f"vpp {self.vpp}"] if self.vpp > 1 else []
        pipeline += [self.schedule] if self.schedule and self.pp > 1 else []
        parts = [f"tp {self.tp}", f"pp {self.pp}" + (f" ({', '.join(pipeline)})" if pipeline else ""), dp]
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
        schedule=d.pipeline_schedule,
    )


# -- parameters ---------------------------------------------------------------------------------------


def local_kv_rows(m: ModelConfig, tp: int) -> int:
    """Rows of each k/v projection on one TP rank: split when kv heads divide by tp, else replicated."""
    kv = m.kv_heads * attention_head_dim(m)
    return kv // tp if m.kv_heads % tp == 0 else kv


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
    """The MoE layers of the recipe's family (its ``ModelSpec.moe_structure``), None for a dense family.

    The planner asks this once per layer of every stage of every layout it tries (about a million times
    for a 64-rank search); the answer for the last config asked is kept while none of its fields changed."""
    fields = vars(m)
    last = _LAST_MOE_STRUCTURE.get("entry")
    if last is not None and last[0] is m and last[1] == fields:
        return last[2]
    describe = get_model_spec(m.type).moe_structure
    structure = describe(m) if describe is not None else None
    snapshot = {k: copy.copy(v) if isinstance(v, (list, dict)) else v for k, v in fields.items()}
    _LAST_MOE_STRUCTURE["entry"] = (m, snapshot, structure)
    return structure


_LAST_MOE_STRUCTURE: dict[str, tuple] = {}


def is_moe_layer(m: ModelConfig, layer_id: int) -> bool:
    moe = moe_structure(m)
    return moe is not None and moe.moe_layers[layer_id]


def is_linear_attention_layer(m: ModelConfig, layer_id: int) -> bool:
    """Whether layer ``layer_id`` is a Gated DeltaNet (the family's ``DecoderArch.linear_attention_layers``)."""
    which = architecture(m).linear_attention_layers
    return which is not None and which(m)[layer_id]


LayerKind = tuple[bool, bool]  # (an MoE layer, a Gated DeltaNet layer): layers of one kind count alike


def layer_kind(m: ModelConfig, layer_id: int) -> LayerKind:
    return is_moe_layer(m, layer_id), is_linear_attention_layer(m, layer_id)


def query_width(m: ModelConfig) -> int:
    """Rows of the q projection (columns of the output projection): heads x head_dim."""
    return m.num_attention_heads * attention_head_dim(m)


def attention_parameters_per_rank(m: ModelConfig, tp: int) -> int:
    """q, k, v and output projections of one layer on one TP rank, with their biases and q/k norms
    (latent attention: :mod:`megacann.planning.mla`), and an output gate's rows of q_proj."""
    arch = architecture(m)
    if arch.latent_attention:
        return mla.latent_attention_parameters_per_rank(m, tp) + (
            mla.indexer_parameters(m) if arch.sparse_indexer else 0
        )
    h, q, kv = m.hidden_size, query_width(m) // tp, local_kv_rows(m, tp)
    qkv_bias = m.use_bias if arch.qkv_bias is None else arch.qkv_bias
    total = h * q + 2 * kv * h + q * h + (h * q if arch.attention_output_gate else 0)
    total += m.num_attention_heads // tp if arch.attention_sinks else 0  # split with the heads
    total += (q + 2 * kv) if qkv_bias else 0  # split like their rows
    total += h if m.use_bias else 0  # o_proj's, replicated
    return total + (2 * attention_head_dim(m) if arch.qk_norm else 0)  # per-head norms, whole on every rank


def layer_parameters_per_rank(m: ModelConfig, tp: int, layer_id: int = 0, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of transformer layer ``layer_id`` held by one TP rank (of one
    expert-parallel rank): attention, two norms and the MLP, or an MoE layer's router, shared and routed
    experts (the only expert parameters); a Gated DeltaNet layer's token mixer as
    :mod:`megacann.planning.gated_deltanet` says."""
    arch = architecture(m)
    h, f = m.hidden_size, m.ffn_size
    linear = is_linear_attention_layer(m, layer_id)
    mixer = gated_deltanet_parameters_per_rank(m, tp) if linear else attention_parameters_per_rank(m, tp)
    dense = mixer + 2 * arch.norm_parameters_per_width * h
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
    formulas = get_model_spec(m.type).rank_parameters
    if formulas is not None and get_model_spec(m.type).architecture is None:  # not a standard decoder
        layers = [formulas.layer(m, tp, i, ep) for i in layer_ids]
        experts = sum(e for _, e in layers)
        total = sum(d for d, _ in layers) + experts + (vocab * h if first else 0)
        if last:
            total += formulas.head(m) + (vocab * h if not m.tie_word_embeddings or pp > 1 else 0)
        return total, experts
    by_kind: dict[LayerKind, tuple[int, int]] = {}  # a layer's count depends only on its kind
    per_layer = []
    for i in layer_ids:
        kind = layer_kind(m, i)
        if kind not in by_kind:
            by_kind[kind] = layer_parameters_per_rank(m, tp, i, ep)
        per_layer.append(by_kind[kind])
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


def fused_op(cfg: MegacannConfig, op: str) -> bool:
    """Whether the recipe lets ``op`` use its fused implementations (precision.fused_ops)."""
    fused = cfg.precision.fused_ops
    return fused is True or (not isinstance(fused, bool) and op in fused)


def fused_head_loss(cfg: MegacannConfig) -> bool:
    """Whether the recipe lets the output head use the fused, chunked loss (precision.fused_ops)."""
    return fused_op(cfg, HEAD_LOSS)


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
