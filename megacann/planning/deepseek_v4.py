"""Memory formulas of DeepSeek-V4 (``model.type: deepseek_v4``): parameters per rank of its blocks.

The family is not a standard decoder (its residual is ``hc_mult`` streams, its attention a
:class:`~megacann.layers.compressed_attention.CompressedSparseAttention`), so the planner counts it here.

**Parameters** of one layer on one rank (t = TP size, ep = expert-parallel size, h hidden, n heads of width
d, r_q the q latent, g output groups of rank r_o, E routed experts of width f, one shared expert of width f):

- split over TP with the heads: ``q_b_proj`` (r_q n d / t), ``sinks`` (n / t), the grouped output
  projection's two parts (n d r_o / t and g r_o h / t);
- whole on every TP rank: ``q_a_proj`` and ``q_a_norm`` (h r_q + r_q), the KV head ``kv_proj`` and
  ``kv_norm`` (h d + d), a compressed layer's window compressor and a compressed sparse layer's indexer
  (:func:`~megacann.models.deepseek_v4.v4_attention_parameters` counts them), the two hyper-connections
  and the two norms;
- the MoE block: the router (E h, whole, dense), the shared expert (3 h f / t, dense) and E / ep routed
  experts (3 h f / t each, expert parameters). The routing correction bias and the hash table of a
  ``hash_moe`` layer are buffers: no gradient, no optimizer state, not counted.

In a bf16 / fp16 model some parameters stay fp32 (:func:`v4_fp32_parameters_per_rank`): the
hyper-connections and their head, the sinks and the compressors' and indexer's position biases. Each holds
4 weight bytes and has no master copy (its optimizer state alone). The routing correction bias is an fp32
parameter outside the optimizer: it is not counted.

Outside the layers: the embedding (vocabulary padded and split over TP) on the first stage; the
hyper-connection head, the final norm and the output layer on the last.

**Activations** are not estimated yet (the hyper-connections' mixing, the compressed attention's blocks
and the compressor / indexer have no formulas): :func:`refuse_activations` says so by name.
"""

from __future__ import annotations

from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.models.deepseek_v4 import hyper_connection_parameters, hyper_head_parameters, v4_attention_parameters
from megacann.models.deepseek_v4_config import CSA, HCA, v4_compress_rates, v4_layer_types

FAMILY = "deepseek_v4"


def is_deepseek_v4(m: ModelConfig) -> bool:
    return m.type == FAMILY


def v4_attention_parameters_per_rank(m: ModelConfig, tp: int, layer_type: str) -> int:
    """One layer's compressed attention on one TP rank: the whole layer less the head-split parts' other
    ranks' shares (see the module docstring)."""
    width = m.num_attention_heads * m.head_dim
    split = (
        m.q_lora_rank * width
        + m.num_attention_heads
        + width * m.o_lora_rank
        + m.o_groups * m.o_lora_rank * m.hidden_size
    )
    return v4_attention_parameters(m, layer_type) - split + split // tp


def v4_layer_parameters_per_rank(m: ModelConfig, tp: int, layer_id: int, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of layer ``layer_id`` on one TP rank of one expert-parallel rank."""
    h, f = m.hidden_size, m.moe_ffn_hidden_size
    attention = v4_attention_parameters_per_rank(m, tp, v4_layer_types(m)[layer_id])
    dense = attention + 2 * hyper_connection_parameters(m) + 2 * h
    dense += m.num_experts * h + 3 * h * f * m.moe_shared_experts // tp
    return dense, m.num_experts // ep * 3 * h * f // tp


def v4_fp32_parameters_per_rank(m: ModelConfig, tp: int, layer_ids: list[int], last: bool) -> int:
    """Parameters of these layers (and the hyper-connection head when ``last``) kept in fp32 whatever the
    model's precision, on one TP rank: hyper-connections, sinks (split), position biases (whole)."""
    rates, kinds = v4_compress_rates(m), v4_layer_types(m)
    biases = {CSA: rates[CSA] * 2 * (m.head_dim + m.index_head_dim), HCA: rates[HCA] * m.head_dim}
    per_layer = 2 * hyper_connection_parameters(m) + m.num_attention_heads // tp
    fp32 = sum(per_layer + biases.get(kinds[i], 0) for i in layer_ids)
    return fp32 + (hyper_head_parameters(m) if last else 0)


def v4_head_parameters(m: ModelConfig) -> int:
    """The last stage's hyper-connection head and final norm (the output layer is counted apart)."""
    return hyper_head_parameters(m) + m.hidden_size


def refuse_activations(m: ModelConfig) -> None:
    """Refuse, by name, an activation estimate for DeepSeek-V4 (never a wrong number)."""
    if is_deepseek_v4(m):
        raise ConfigError(
            f"model.type {FAMILY!r}: megacann-plan has no activation formulas for its hyper-connections, "
            "compressed attention and compressor / indexer yet; it estimates weights, gradients and optimizer "
            "state only"
        )


def v4_static_stages(cfg: MegacannConfig, layout) -> list[dict[str, float]]:
    """Per pipeline stage (stage 0 first) of a DeepSeek-V4 recipe: {"params", "expert_params", "weights",
    "grads", "optimizer", "host_optimizer"} on one of its devices, chunk by chunk as the trainer cuts them."""
    from megacann.pipeline import stage_layer_ids
    from megacann.pipeline.placement import LOOP
    from megacann.pipeline.schedule_spec import find_schedule
    from megacann.planning.formulas import MASTER_BYTES, chunk_parameters_per_rank, weight_bytes_per_param
    from megacann.planning.placement import placed_static_bytes

    spec = find_schedule(layout.schedule)
    placement = spec.placement if spec is not None and layout.pp > 1 else LOOP
    chunks, m = placement.chunks(layout.vpp), cfg.model
    widen = 4 - weight_bytes_per_param(cfg)  # an fp32 parameter's extra weight bytes in a bf16 model
    stages = []
    for stage in range(layout.pp):
        params = experts = unit = fp32 = 0
        for chunk in range(chunks):
            ids = stage_layer_ids(
                m.num_layers, layout.pp, stage, chunks, chunk, cfg.distributed.pipeline_layers, placement=placement
            )
            first = placement.is_model_first(stage, chunk)
            last = placement.is_model_last(layout.pp, stage, chunk, chunks)
            p, e = chunk_parameters_per_rank(cfg, layout.tp, ids, first, last, layout.pp, layout.ep)
            params, experts = params + p, experts + e
            fp32 += v4_fp32_parameters_per_rank(m, layout.tp, ids, last) if widen else 0
            unit = max([unit] + [sum(v4_layer_parameters_per_rank(m, layout.tp, i, layout.ep)) for i in ids])
        static = placed_static_bytes(cfg, layout, params, experts, unit)
        static["weights"] += widen * fp32
        static["optimizer"] -= MASTER_BYTES * (fp32 / layout.zero_shards if layout.zero else fp32)
        stages.append({"params": params, "expert_params": experts, **static})
    return stages
