"""Mixture of experts: a LLaMA-style decoder whose feed-forward blocks are MoE layers (Mixtral, DeepSeek-style).

    tokens -> embed_tokens -> layers[i] (attention, then a dense SwiGLU MLP or an MoE layer) ... -> norm -> lm_head

``model.moe_layer_freq`` says which layers are MoE: every N-th from layer 0 (1: all of them), or a 0/1
flag per layer (DeepSeek keeps its first layers dense). An MoE layer (:class:`megacann.layers.MoELayer`)
has ``model.num_experts`` SwiGLU experts of width ``model.moe_ffn_hidden_size``, sends each token to
``model.moe_top_k`` of them (``model.moe_router``: softmax or sigmoid scores), optionally drops tokens
over ``model.moe_capacity_factor``, and adds ``model.moe_shared_experts`` shared experts. Balancing:
``moe_aux_loss_coeff`` (load-balancing loss, over the micro-batch or, with
``moe_router_load_balancing_type: seq_aux_loss``, per sequence), ``moe_z_loss_coeff`` (router z-loss) and
``moe_bias_update_rate`` (DeepSeek-V3's auxiliary-loss-free bias, moved after every optimizer step).
With ``distributed.expert_parallel_size`` > 1 each rank holds ``num_experts / ep`` experts.

Everything else about the family goes through the model contract (:class:`ModelSpec`): the forward step
returns each chunk's weighted auxiliary losses and per-expert token counts, the bias update runs after
each optimizer step, sizes and FLOPs count the parameters a token meets (top-k and shared experts), and
the console warns when an expert gets far from its fair share of tokens. Mixtral checkpoints of Hugging
Face convert both ways (:mod:`megacann.models.hf_mixtral`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.layers import MoEConfig, MoELayer, TransformerBlock
from megacann.layers.loss import ChunkOutput
from megacann.layers.moe import moe_layers, update_expert_biases
from megacann.models import sizing
from megacann.models.decoder import DecoderLM, decoder_model_spec
from megacann.models.hf_mixtral import MIXTRAL_HF
from megacann.models.llama import LlamaModel, llama_defaults
from megacann.models.moe_config import MoEModelConfig
from megacann.models.mtp import mtp_depths, mtp_matmul_parameters, mtp_parameters
from megacann.models.spec import Batch, MoEStructure, decoder_forward_step

TOKENS_PER_EXPERT = "moe_tokens_per_expert"  # stats name prefix: f"{TOKENS_PER_EXPERT}/layer_{i}"
DROPPED_TOKENS = "moe_dropped_tokens"
LOW_SHARE, HIGH_SHARE = 0.1, 3.0  # the console warns below a tenth or above three times the fair share


def moe_defaults(cfg: ModelConfig) -> None:
    """LLaMA's defaults, and experts as wide as the dense MLP unless ``moe_ffn_hidden_size`` says otherwise."""
    llama_defaults(cfg)
    if cfg.moe_ffn_hidden_size is None:
        cfg.moe_ffn_hidden_size = cfg.ffn_hidden_size


def is_moe_layer(cfg: ModelConfig, layer_id: int) -> bool:
    """Whether layer ``layer_id`` (global index) has an MoE feed-forward block."""
    freq = cfg.moe_layer_freq
    if isinstance(freq, list):
        return bool(freq[layer_id])
    return layer_id % freq == 0


def num_moe_layers(cfg: ModelConfig) -> int:
    return sum(is_moe_layer(cfg, i) for i in range(cfg.num_layers))


def moe_layer_config(cfg: ModelConfig, block: Any) -> MoEConfig:
    """The MoE layer of a model config, with the dense blocks' parallelism, dtype and initialisation."""
    return MoEConfig(
        hidden_size=cfg.hidden_size,
        num_experts=cfg.num_experts,
        ffn_hidden_size=cfg.moe_ffn_hidden_size,
        top_k=cfg.moe_top_k,
        score_function=cfg.moe_router,
        aux_loss_coeff=cfg.moe_aux_loss_coeff,
        load_balancing_type=cfg.moe_router_load_balancing_type,
        z_loss_coeff=cfg.moe_z_loss_coeff,
        bias_update_rate=cfg.moe_bias_update_rate,
        capacity_factor=cfg.moe_capacity_factor,
        num_shared_experts=cfg.moe_shared_experts,
        sequence_parallel=block.sequence_parallel,
        init_method_std=block.init_method_std,
        output_layer_init_std=block.output_layer_init_std,
        params_dtype=block.params_dtype,
    )


class MoEModel(DecoderLM):
    """One pipeline stage of an MoE decoder (see the module docstring; :class:`DecoderLM` for forward).
    An MoE layer's parameters are ``layers.<i>.mlp.router.weight`` (and the buffer
    ``layers.<i>.mlp.router.expert_bias``), ``layers.<i>.mlp.experts.<e>.{gate_up_proj,down_proj}.weight``
    for the experts this rank holds (global index ``e``) and ``layers.<i>.mlp.shared_experts.*``."""

    ARCH = LlamaModel.ARCH
    fill_defaults = staticmethod(moe_defaults)

    def moe_config(self) -> MoEConfig:
        """The MoE layers' settings (a family with its own routing options overrides this)."""
        return moe_layer_config(self.config, self.block_config)

    def build_layer(self, layer_id: int) -> torch.nn.Module:
        if not is_moe_layer(self.config, layer_id):
            return super().build_layer(layer_id)
        return TransformerBlock(self.block_config, mlp=MoELayer(self.moe_config()))

    def save_pretrained_hf(self, path: str) -> None:
        """Write a Hugging Face Mixtral directory (config.json + safetensors) that transformers loads."""
        from megacann.interop.hf import save_pretrained_hf

        save_pretrained_hf([self], path, self.config)


# -- recipe checks ------------------------------------------------------------------------------------


def _check_layer_freq(m: ModelConfig, source: str) -> None:
    freq = m.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != m.num_layers or any(v not in (0, 1) for v in freq):
            raise ConfigError(
                f"{source}: model.moe_layer_freq as a list needs one 0 (dense) or 1 (MoE) per layer "
                f"({m.num_layers}), got {freq!r}"
            )
    elif freq < 1:
        raise ConfigError(f"{source}: model.moe_layer_freq must be >= 1 (every N-th layer is MoE), got {freq}")
    if num_moe_layers(m) == 0:
        raise ConfigError(f"{source}: model.moe_layer_freq {freq!r} makes no layer an MoE layer")


def check_moe_config(cfg: MegacannConfig, source: str) -> None:
    """What the MoE family needs of a recipe (sizes, ranges, divisibility by the parallel layout)."""
    m, d = cfg.model, cfg.distributed
    if m.num_experts is None:
        raise ConfigError(f"{source}: model.num_experts is not set (the number of routed experts of an MoE layer)")
    if m.num_experts < 1:
        raise ConfigError(f"{source}: model.num_experts must be >= 1, got {m.num_experts}")
    if not 1 <= m.moe_top_k <= m.num_experts:
        raise ConfigError(f"{source}: model.moe_top_k must be in [1, num_experts={m.num_experts}], got {m.moe_top_k}")
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_bias_update_rate", "moe_shared_experts"):
        if getattr(m, key) < 0:
            raise ConfigError(f"{source}: model.{key} must be >= 0, got {getattr(m, key)}")
    if m.moe_capacity_factor is not None and m.moe_capacity_factor <= 0:
        raise ConfigError(
            f"{source}: model.moe_capacity_factor must be > 0 (or null for dropless routing), got {m.moe_capacity_factor}"
        )
    if m.moe_ffn_hidden_size < 1 or m.moe_ffn_hidden_size % d.tensor_parallel_size:
        raise ConfigError(
            f"{source}: model.moe_ffn_hidden_size {m.moe_ffn_hidden_size} must be positive and divisible by "
            f"distributed.tensor_parallel_size {d.tensor_parallel_size} (every expert is split over TP)"
        )
    _check_layer_freq(m, source)
    if m.num_experts % d.expert_parallel_size:
        raise ConfigError(
            f"{source}: model.num_experts {m.num_experts} is not divisible by distributed.expert_parallel_size "
            f"{d.expert_parallel_size}"
        )
    if d.tensor_parallel_size > 1 and cfg.data.seq_length % d.tensor_parallel_size:
        raise ConfigError(
            f"{source}: data.seq_length {cfg.data.seq_length} is not divisible by distributed.tensor_parallel_size "
            f"{d.tensor_parallel_size} (an MoE layer routes each TP rank's share of the sequence)"
        )


# -- sizes and FLOPs ----------------------------------------------------------------------------------


def _moe_mlp_matmul_parameters(m: ModelConfig, active: bool) -> int:
    """Router and expert weights of one MoE layer: all experts, or the ``top_k`` a token meets."""
    h, routed = m.hidden_size, m.moe_top_k if active else m.num_experts
    return m.num_experts * h + 3 * h * m.moe_ffn_hidden_size * (routed + m.moe_shared_experts)


def moe_num_parameters(m: ModelConfig, active: bool = False, model_class: type[MoEModel] = MoEModel) -> int:
    """Parameters of the whole model (``active``: those one token meets: top-k and shared experts);
    ``model_class``: the family's model (its attention: biases, q/k norms)."""
    arch, h = model_class.ARCH, m.hidden_size
    dense_layer = sizing.layer_parameters(m, arch)
    moe_layer = sizing.attention_parameters(m, arch) + 2 * h + _moe_mlp_matmul_parameters(m, active)
    layers = num_moe_layers(m)
    total = (m.num_layers - layers) * dense_layer + layers * moe_layer + h  # + the final norm
    total += mtp_parameters(m, moe_layer if is_moe_layer(m, m.num_layers - 1) else dense_layer)
    vocab = m.vocab_size or 0
    return total + vocab * h * (1 if m.tie_word_embeddings else 2)


def moe_structure(m: ModelConfig) -> MoEStructure:
    """The MoE layers of a (filled) recipe, for estimators such as ``megacann-plan``."""
    return MoEStructure(
        moe_layers=tuple(is_moe_layer(m, i) for i in range(m.num_layers)),
        num_experts=m.num_experts,
        expert_ffn_hidden_size=m.moe_ffn_hidden_size,
        top_k=m.moe_top_k,
        shared_ffn_hidden_size=m.moe_shared_experts * m.moe_ffn_hidden_size,
        capacity_factor=m.moe_capacity_factor,
    )


def moe_flops_per_token(m: ModelConfig, seq_length: int) -> float:
    """PaLM's 6N + 12 L H Q T with N the matrix weights a token meets (top-k and shared experts, router)."""
    layers = num_moe_layers(m)
    dense_mlp = MoEModel.ARCH.mlp_matrices * m.hidden_size * m.ffn_size
    n = m.num_layers * sizing.attention_matmul_parameters(m) + (m.num_layers - layers) * dense_mlp
    n += layers * _moe_mlp_matmul_parameters(m, active=True) + (m.vocab_size or 0) * m.hidden_size
    last = _moe_mlp_matmul_parameters(m, active=True) if is_moe_layer(m, m.num_layers - 1) else dense_mlp
    n += mtp_matmul_parameters(m, sizing.attention_matmul_parameters(m) + last)  # MTP layers: the last one's kind
    return sizing.palm_flops_per_token(n, m, seq_length, extra_layers=mtp_depths(m))


# -- the forward step, the bias update and the console ------------------------------------------------


def moe_forward_step(chunk: torch.nn.Module, batch: Batch, hidden_states: Optional[torch.Tensor]) -> ChunkOutput:
    """The decoder's forward step, plus the chunk's MoE figures of this micro-batch: ``aux_losses``
    ``moe_load_balancing`` (or ``moe_seq_load_balancing``) / ``moe_z_loss`` (weighted, summed over the
    chunk's layers) and ``stats`` ``moe_tokens_per_expert/layer_<i>`` (choices per expert, before dropping)
    and, with a capacity, ``moe_dropped_tokens``."""
    out = decoder_forward_step(chunk, batch, hidden_states)
    dropped: list[int] = []
    blocks = list(chunk.layers.items())
    if getattr(chunk, "mtp", None) is not None:  # multi-token prediction's layers, named mtp_<depth index>
        blocks += [(f"mtp_{k}", layer.transformer_layer) for k, layer in enumerate(chunk.mtp.layers)]
    for layer_id, block in blocks:
        moe = getattr(block, "mlp", None)
        if not isinstance(moe, MoELayer) or moe.last_stats is None:
            continue
        stats = moe.last_stats
        for name, loss in stats.aux_losses.items():
            key = f"moe_{name}"
            out.aux_losses[key] = out.aux_losses[key] + loss if key in out.aux_losses else loss
        counts = out.stats[f"{TOKENS_PER_EXPERT}/layer_{layer_id}"] = stats.tokens_per_expert
        if moe.config.capacity_factor is not None:
            dropped.append(stats.dropped_tokens)
    if dropped:
        out.stats[DROPPED_TOKENS] = torch.tensor(float(sum(dropped)), device=counts.device)
    return out


def update_router_biases(chunks: list[torch.nn.Module]) -> None:
    """After an optimizer step: auxiliary-loss-free balancing of every MoE layer of this rank's chunks."""
    update_expert_biases([layer for chunk in chunks for layer in moe_layers(chunk)])


def expert_load_warnings(record: dict[str, Any]) -> list[str]:
    """One line per MoE layer where an expert got under a tenth or over three times its fair share of
    the token choices of the logged step (fair share: the layer's choices divided by its experts)."""
    lines = []
    for name, counts in record.items():
        if not name.startswith(TOKENS_PER_EXPERT + "/") or not isinstance(counts, list) or not counts:
            continue
        fair = sum(counts) / len(counts)
        if fair <= 0:
            continue
        low = [e for e, c in enumerate(counts) if c < LOW_SHARE * fair]
        high = [e for e, c in enumerate(counts) if c > HIGH_SHARE * fair]
        if not low and not high:
            continue
        parts = []
        if low:
            parts.append(f"expert(s) {low} got under 1/10 of it ({[int(counts[e]) for e in low]})")
        if high:
            parts.append(f"expert(s) {high} over 3x ({[int(counts[e]) for e in high]})")
        layer = name.split("/", 1)[1].replace("_", " ")
        lines.append(
            f"MoE {layer}: fair share {fair:.0f} token choices per expert; {'; '.join(parts)} "
            "(balance with model.moe_aux_loss_coeff or model.moe_bias_update_rate)"
        )
    return lines


MOE = dataclasses.replace(
    decoder_model_spec("moe", MoEModel, check_config=check_moe_config, hf=MIXTRAL_HF),
    flops_per_token=moe_flops_per_token,
    num_parameters=moe_num_parameters,
    active_parameters=lambda m: moe_num_parameters(m, active=True),
    forward_step=moe_forward_step,
    after_optimizer_step=update_router_biases,
    metric_warnings=expert_load_warnings,
    architecture=MoEModel.ARCH,
    moe_structure=moe_structure,
    mixture_of_experts=True,
    config_class=MoEModelConfig,
)


def moe_family_spec(name: str, model_class: type[MoEModel], *, check_config, hf, **overrides: Any):
    """The spec of a family built on the MoE family (its forward step, router-bias update and load
    warnings): ``model_class`` builds the chunks; ``overrides`` replace further fields (sizes, config class)."""
    base = decoder_model_spec(name, model_class, check_config=check_config, hf=hf)
    return dataclasses.replace(
        MOE,
        name=name,
        build_chunk=base.build_chunk,
        fill_defaults=base.fill_defaults,
        check_config=base.check_config,
        hf=hf,
        architecture=model_class.ARCH,
        **overrides,
    )
