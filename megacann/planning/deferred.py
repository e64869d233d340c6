"""What a split backward's B leaves for its W (zb1p, zbv, dualpipev), per model chunk and micro-batch.

B (:mod:`megacann.pipeline.split_backward`) back-propagates through the chunk's autograd graph and frees
it as it goes: of the saved activations only what the weight-gradient closures of the
:class:`~megacann.ops.weight_grad.WeightGradStore` capture survives until W, that is each deferred
product's INPUT and its OUTPUT GRADIENT; the store also holds the gradients B computed for the other
parameters, and the executor the received gradient and the chunk's output. Per transformer layer and token
(a = bytes of the weights' dtype, t = TP size, q = heads x head_dim, kv = the k (and v) rows a rank
computes, h hidden, f ffn; tokens as the activations count them, s/cp of every sequence):

- output gradients: attention's q, k, v and output projections a (q/t + 2kv + h) (the row-parallel output
  whole, also under sequence parallelism, whose reduce-scatter's backward gathers it; latent attention:
  its q/kv down- and up-projections' and o_proj's, :mod:`megacann.planning.mla` widths); the dense MLP's
  gate|up and down a (2f/t + h), or up and down without a gate a (f/t + h); MoE
  (:mod:`megacann.planning.moe`): per routed row a (2 f_e/t + h), the shared experts as a dense SwiGLU MLP
  of width f_s;
- inputs: attention a (h + q/t) (q, k and v read one input; latent attention: h, the latents and o_proj's
  n d_v/t), the MLP a (h + f/t), per routed row a (h + f_e/t), the shared experts a (h + f_s/t); the
  same with ``full`` recompute or activation offload, where B rebuilds or brings them back;
- B's parameter gradients (per layer, not per token): norms, biases and the router, a bytes per parameter.

The routed experts' products defer with the grouped matmul's fused implementations; the reference one
(``precision.fused_ops`` without ``grouped_matmul``) computes their weight gradients in B instead (their
parameters' bytes, no rows). Per chunk: the received output gradient (not on the last chunk; h a per
token, s/t tokens under sequence parallelism); the chunk's last layer's down projection reads it as its
own output gradient (the residual add passes it on) unless a reduce-scatter gathers it (sequence
parallelism with t > 1), so it is counted once. The last chunk: the final norm's gradient and the head's
input (a h per token, gathered over the sequence), with the fused head loss the targets, the float32
log-sum-exp and the loss gradient (12 per token and one float32: W recomputes the logits), with the unfused
loss the logits' gradient (a V/t per token; in fp32 written over the saved exponentials); under ZeRO-3,
which does not defer the fused head's weight gradient, only that gradient (V/t x h x a). Each
multi-token prediction depth on the last chunk: a layer of the last layer's kind, a head's, and its own
embedding output gradient and int64 ids, eh_proj's input (2h) and output gradient (h/t) and two norms'
gradients. The model's first chunk runs no B (no input to differentiate; its W is the fused backward): its
activations stay until W.

The estimate (:mod:`megacann.planning.estimate`) replays this: a chunk's activations from F to B, these
bytes and the chunk's output from B to W. Not counted: LoRA (the planner counts the base weights as
trained; frozen, they defer nothing, their adapters keep their own inputs and gradients), the CPU head
loss's weight gradient summed in the forward, and the CUDA grouped matmul's stacked weight copy its W
closure keeps. tests/test_planner_deferred.py measures the terms (LLaMA, GPT, MoE, latent attention, MTP;
tp 1 and 2, sequence parallelism, full recompute, activation offload) against the tensors a store holds
after B, to the byte, and that no other saved activation outlives B; the ZeRO-3 head term is not measured.
"""

from __future__ import annotations

from typing import Optional

from megacann.config import MegacannConfig
from megacann.models.mtp import mtp_depths
from megacann.planning import mla
from megacann.planning.activations import boundary_tensor_bytes, kv_read_width, tokens_per_rank
from megacann.planning.formulas import (
    DTYPE_BYTES,
    Layout,
    architecture,
    fused_head_loss,
    fused_op,
    is_moe_layer,
    layer_parameters_per_rank,
    local_kv_rows,
    moe_structure,
    padded_vocab,
    query_width,
)
from megacann.planning.moe import moe_parameters_per_rank, routed_rows


def _deferred_matrix_parameters(cfg: MegacannConfig, layout: Layout, layer_id: int) -> int:
    """Parameters of one layer's deferred products on one rank: the projections, shared and routed experts
    (not the router's)."""
    m, t = cfg.model, layout.tp
    arch = architecture(m)
    h, q = m.hidden_size, query_width(m) // t
    if arch.latent_attention:  # less the latent norms
        attention = mla.latent_attention_parameters_per_rank(m, t) - (m.q_lora_rank or 0) - m.kv_lora_rank
    else:
        attention = 2 * h * q + 2 * h * local_kv_rows(m, t)
    moe = moe_structure(m)
    if moe is not None and moe.moe_layers[layer_id]:
        router_shared, experts = moe_parameters_per_rank(h, t, layout.ep, moe)
        grouped = experts if fused_op(cfg, "grouped_matmul") else 0  # the reference's F.linear: in B
        return attention + router_shared - moe.num_experts * h + grouped
    return attention + arch.mlp_matrices * h * m.ffn_size // t


def layer_held_terms(cfg: MegacannConfig, layout: Layout, layer_id: int) -> dict[str, float]:
    """Bytes layer ``layer_id`` keeps from B to W for one micro-batch, by what holds them."""
    m = cfg.model
    a, t = DTYPE_BYTES[m.precision], layout.tp
    h, tokens, arch = m.hidden_size, tokens_per_rank(cfg, layout), architecture(m)
    if arch.latent_attention:
        heads = m.num_attention_heads // t
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        widths = (m.q_lora_rank or 0) + heads * qk + m.kv_lora_rank + m.qk_rope_head_dim
        attention = widths + heads * (m.qk_nope_head_dim + m.v_head_dim) + h
    else:
        attention = query_width(m) // t + 2 * kv_read_width(m, t) + h
    terms = {"attention output gradients": tokens * a * attention}
    moe = moe_structure(m)
    if moe is not None and moe.moe_layers[layer_id]:
        if fused_op(cfg, "grouped_matmul"):
            rows = routed_rows(tokens, moe)
            terms["routed experts' output gradients"] = rows * a * (2 * moe.expert_ffn_hidden_size // t + h)
        if moe.shared_ffn_hidden_size:
            terms["shared experts' output gradients"] = tokens * a * (2 * moe.shared_ffn_hidden_size // t + h)
    else:
        terms["mlp output gradients"] = tokens * a * ((arch.mlp_matrices - 1) * m.ffn_size // t + h)
    dense, experts = layer_parameters_per_rank(m, t, layer_id, layout.ep)
    terms["parameter gradients computed in B"] = a * (
        dense + experts - _deferred_matrix_parameters(cfg, layout, layer_id)
    )
    return terms


def layer_rebuilt_input_terms(cfg: MegacannConfig, layout: Layout, layer_id: int) -> dict[str, float]:
    """Bytes of the deferred products' inputs of one layer whose B rebuilds its activations (full recompute,
    or an offloaded layer's brought back): W's closures keep them, for one micro-batch."""
    m = cfg.model
    a, t = DTYPE_BYTES[m.precision], layout.tp
    h, tokens, arch = m.hidden_size, tokens_per_rank(cfg, layout), architecture(m)
    if arch.latent_attention:  # q_a / kv_a (or q_proj) read the layer's normed input, then the latents, o_proj
        attention = h + (m.q_lora_rank or 0) + m.kv_lora_rank + m.num_attention_heads // t * m.v_head_dim
    else:  # q, k and v read one input, o_proj the attention's output
        attention = h + query_width(m) // t
    terms = {"attention inputs": tokens * a * attention}
    moe = moe_structure(m)
    if moe is not None and moe.moe_layers[layer_id]:
        if fused_op(cfg, "grouped_matmul"):
            rows = routed_rows(tokens, moe)
            terms["routed experts' inputs"] = rows * a * (h + moe.expert_ffn_hidden_size // t)
        if moe.shared_ffn_hidden_size:
            terms["shared experts' inputs"] = tokens * a * (h + moe.shared_ffn_hidden_size // t)
    else:  # gate|up (or up) and down
        terms["mlp inputs"] = tokens * a * (h + m.ffn_size // t)
    return terms


def chunk_held_bytes(
    cfg: MegacannConfig,
    layout: Layout,
    layer_ids: list[int],
    first: bool,
    last: bool,
    per_kind: dict,
    kinds: Optional[list[bool]] = None,
) -> float:
    """Bytes a model chunk's B leaves for its W, one micro-batch: what W's closures keep (the products'
    inputs and output gradients), B's parameter gradients and the received gradient (``per_kind``: a cache
    of the layer totals by kind of layer, shared by a stage's chunks; ``kinds``: whether each layer is an
    MoE layer, when the caller knows). The model's first chunk: the received gradient only."""
    received = 0.0 if last else boundary_tensor_bytes(cfg, layout)
    if first:  # no B: W is the fused backward
        return received
    m = cfg.model
    kinds = [is_moe_layer(m, i) for i in layer_ids] if kinds is None else kinds
    total = 0.0
    for i, moe in zip(layer_ids, kinds):
        if moe not in per_kind:
            terms = {**layer_held_terms(cfg, layout, i), **layer_rebuilt_input_terms(cfg, layout, i)}
            per_kind[moe] = sum(terms.values())
        total += per_kind[moe]
    # the chunk's last layer's final product takes the received gradient as its own output gradient (a dense
    # MLP's down projection, an MoE layer's shared experts') unless a reduce-scatter gathers it in between
    gathered = layout.sequence_parallel and layout.tp > 1
    if layer_ids and not gathered and (not kinds[-1] or moe_structure(m).shared_ffn_hidden_size):
        received = 0.0  # one tensor, counted with the layer
    if last:
        total += sum(head_held_terms(cfg, layout).values()) + _mtp_held_bytes(cfg, layout, per_kind)
    return total + received


def _mtp_held_bytes(cfg: MegacannConfig, layout: Layout, per_kind: dict) -> float:
    """What the multi-token prediction depths on the last chunk leave from B to W: per depth a layer of the
    last layer's kind, a head's, the embedding's output gradient and ids, eh_proj's input (the two normed
    halves, 2h) and output gradient (h/t), and the gradients of its two norms."""
    m = cfg.model
    depths = mtp_depths(m)
    if not depths:
        return 0.0
    a, t, h, last = DTYPE_BYTES[m.precision], layout.tp, m.hidden_size, m.num_layers - 1
    moe = is_moe_layer(m, last)
    if moe not in per_kind:
        per_kind[moe] = sum(
            {**layer_held_terms(cfg, layout, last), **layer_rebuilt_input_terms(cfg, layout, last)}.values()
        )
    own = tokens_per_rank(cfg, layout) * (a * (3 * h + h // t) + 8) + 2 * h * a
    return depths * (per_kind[moe] + sum(head_held_terms(cfg, layout).values()) + own)


def head_held_terms(cfg: MegacannConfig, layout: Layout) -> dict[str, float]:
    """Bytes the last chunk's final norm and head leave from B to W for one micro-batch."""
    m = cfg.model
    a, t = DTYPE_BYTES[m.precision], layout.tp
    tokens = tokens_per_rank(cfg, layout)
    terms = {"final norm's gradient": a * architecture(m).norm_parameters_per_width * m.hidden_size}
    vocab = padded_vocab(cfg, t) // t
    if layout.zero >= 3 and fused_head_loss(cfg):  # ZeRO-3 frees the weight after B: its gradient comes with B
        terms["head weight's gradient"] = a * vocab * m.hidden_size
        return terms
    terms["head input"] = tokens * a * m.hidden_size  # gathered over the sequence under sequence parallelism
    if fused_head_loss(cfg):  # W recomputes the logits from the input, the targets and the log-sum-exp
        terms["targets, log-sum-exp, loss gradient"] = tokens * 12 + 4.0  # the mean's gradient: one value
    else:  # in fp32 written over the saved float32 exponentials
        terms["logits' gradient"] = tokens * a * vocab
    return terms
