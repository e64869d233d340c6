"""Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE: LLaMA-style decoders with their own attention details.

- ``qwen2`` (Hugging Face ``model_type: qwen2``): LLaMA with biases on the q, k and v projections only
  (none on o_proj or the MLP); small sizes tie the embeddings (``tie_word_embeddings``).
- ``qwen3`` (``qwen3``): LLaMA with an RMSNorm of width ``head_dim`` on every query and key head before
  RoPE (:class:`~megacann.layers.SelfAttention`'s ``qk_norm``), heads of width ``head_dim`` (which may
  differ from hidden_size / num_attention_heads) and no biases.
- ``qwen3_moe`` (``qwen3_moe``): Qwen3's attention and the MoE family's layers (:mod:`megacann.models.moe`):
  softmax over all experts, top ``moe_top_k``, renormalised when ``norm_topk_prob``, no shared experts;
  MoE layers every ``decoder_sparse_step`` layers except ``mlp_only_layers`` (dense MLPs there).

Sliding windows (``use_sliding_window: true``) are refused: these families attend over the whole sequence,
as every published Qwen2.5 / Qwen3 checkpoint does (they ship with ``use_sliding_window: false``).
Hugging Face checkpoints convert both ways (:mod:`megacann.models.hf_qwen`).
"""

from __future__ import annotations

import dataclasses

from megacann.config import ConfigError, MegacannConfig, ModelConfig
from megacann.layers import MoEConfig
from megacann.models.decoder import DecoderArch, decoder_model_spec
from megacann.models.hf_qwen import QWEN2_HF, QWEN3_HF, QWEN3_MOE_HF
from megacann.models.llama import LlamaModel
from megacann.models.moe import (
    MoEModel,
    check_moe_config,
    moe_defaults,
    moe_model_spec,
    moe_num_parameters,
    moe_structure,
)
from megacann.models.qwen_config import (
    Qwen2ModelConfig,
    Qwen3ModelConfig,
    Qwen3MoeModelConfig,
    qwen3_moe_layer_flags,
)
from megacann.models.spec import MoEStructure

QWEN3_ARCH = DecoderArch(normalization="rmsnorm", activation="swiglu", position_embedding="rope", qk_norm=True)


class Qwen2Model(LlamaModel):
    """A Qwen2 / Qwen2.5 model: LLaMA with q, k, v biases. See :class:`DecoderLM` for forward."""

    ARCH = dataclasses.replace(LlamaModel.ARCH, qkv_bias=True)


class Qwen3Model(LlamaModel):
    """A dense Qwen3 model: per-head q/k RMSNorm, heads of width ``head_dim``. See :class:`DecoderLM`."""

    ARCH = QWEN3_ARCH


def qwen3_moe_defaults(cfg: ModelConfig) -> None:
    """The MoE family's defaults, and the MoE layers from ``decoder_sparse_step`` / ``mlp_only_layers``."""
    moe_defaults(cfg)
    if cfg.moe_layer_freq is None and cfg.num_layers and cfg.decoder_sparse_step >= 1:
        cfg.moe_layer_freq = qwen3_moe_layer_flags(cfg)


class Qwen3MoeModel(MoEModel):
    """A Qwen3-MoE model: Qwen3's attention, MoE layers routed as Qwen3-MoE does (``norm_topk_prob``)."""

    ARCH = QWEN3_ARCH
    fill_defaults = staticmethod(qwen3_moe_defaults)

    def moe_config(self) -> MoEConfig:
        return dataclasses.replace(super().moe_config(), normalize_top_k=self.config.norm_topk_prob)


# -- recipe checks ------------------------------------------------------------------------------------


def check_qwen_config(cfg: MegacannConfig, source: str) -> None:
    """What every Qwen family refuses: sliding windows, biases other than the family's own, odd heads."""
    m = cfg.model
    if m.use_sliding_window:
        raise ConfigError(
            f"{source}: model.use_sliding_window true is refused: megacann's {m.type} family attends over the "
            "whole sequence (published Qwen2.5 / Qwen3 checkpoints set use_sliding_window: false)"
        )
    if m.add_bias_linear:
        raise ConfigError(
            f"{source}: model.add_bias_linear true is refused: the biases of family {m.type!r} are fixed "
            "(qwen2: on the q, k and v projections only; qwen3, qwen3_moe: none)"
        )
    head_dim = getattr(m, "head_dim", None)
    if head_dim is not None and (head_dim < 2 or head_dim % 2):
        raise ConfigError(f"{source}: model.head_dim must be a positive even number (RoPE pairs), got {head_dim}")


def check_qwen3_moe_config(cfg: MegacannConfig, source: str) -> None:
    """Qwen's checks, the MoE layers' rule, Qwen3-MoE's routing, then the MoE family's checks."""
    check_qwen_config(cfg, source)
    m = cfg.model
    if m.decoder_sparse_step < 1:
        raise ConfigError(f"{source}: model.decoder_sparse_step must be >= 1, got {m.decoder_sparse_step}")
    bad = [i for i in m.mlp_only_layers if not isinstance(i, int) or not 0 <= i < m.num_layers]
    if bad:
        raise ConfigError(f"{source}: model.mlp_only_layers {bad} are not layer indices in [0, {m.num_layers})")
    flags = qwen3_moe_layer_flags(m)
    if m.moe_layer_freq != flags:
        raise ConfigError(
            f"{source}: model.moe_layer_freq {m.moe_layer_freq!r} disagrees with decoder_sparse_step "
            f"{m.decoder_sparse_step} and mlp_only_layers {m.mlp_only_layers} ({flags}); family qwen3_moe derives "
            "it from those two: set them instead"
        )
    if m.moe_shared_experts or m.moe_router != "softmax":
        raise ConfigError(
            f"{source}: model.moe_shared_experts {m.moe_shared_experts} / moe_router {m.moe_router!r}: Qwen3-MoE "
            "routes by softmax without shared experts (0, softmax); model.type: moe has the other choices"
        )
    if m.norm_topk_prob and m.moe_top_k == 1:
        raise ConfigError(
            f"{source}: model.norm_topk_prob with moe_top_k 1 is refused: the one weight would be 1 and the "
            "router would get no gradient"
        )
    check_moe_config(cfg, source)


# -- the specs ----------------------------------------------------------------------------------------


def _qwen3_moe_structure(m: ModelConfig) -> MoEStructure:
    m = dataclasses.replace(m)  # the MoE layers from decoder_sparse_step / mlp_only_layers when unset
    qwen3_moe_defaults(m)
    return dataclasses.replace(moe_structure(m), normalize_top_k=m.norm_topk_prob)


def _qwen3_moe_parameters(m: ModelConfig, active: bool = False) -> int:
    m = dataclasses.replace(m)  # counted with the family's defaults, the recipe left as it is
    qwen3_moe_defaults(m)
    return moe_num_parameters(m, active, Qwen3MoeModel)


QWEN2 = dataclasses.replace(
    decoder_model_spec("qwen2", Qwen2Model, check_config=check_qwen_config, hf=QWEN2_HF),
    config_class=Qwen2ModelConfig,
)
QWEN3 = dataclasses.replace(
    decoder_model_spec("qwen3", Qwen3Model, check_config=check_qwen_config, hf=QWEN3_HF),
    config_class=Qwen3ModelConfig,
)
QWEN3_MOE = moe_model_spec(
    "qwen3_moe",
    Qwen3MoeModel,
    config_class=Qwen3MoeModelConfig,
    check_config=check_qwen3_moe_config,
    hf=QWEN3_MOE_HF,
    num_parameters=_qwen3_moe_parameters,
    structure=_qwen3_moe_structure,
)
