"""Multi-token prediction as a capability families opt into: its recipe keys, their checks, sizes and FLOPs.

A family carries MTP by deriving its config class from :class:`MTPKeys` (``class MyConfig(MTPKeys,
ModelConfig)``) and its model from :class:`~megacann.models.DecoderLM`, which builds the depths
(:class:`~megacann.layers.multi_token_prediction.MultiTokenPrediction`) on the last pipeline stage when
``model.mtp_num_layers`` > 0. A family without the keys refuses them as keys of other families.
LLaMA, the MoE family (and those built on it) carry them; docs/models.md has the details.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megacann.config import ConfigError, MegacannConfig, ModelConfig


@dataclass
class MTPKeys:
    """Megatron-Core's names: ``mtp_num_layers`` depths (0: off), each predicting one more token ahead;
    their mean loss times ``mtp_loss_scaling_factor`` is added to the main loss (logged as ``mtp_loss``)."""

    mtp_num_layers: int = field(default=0, metadata={"shape": True})
    mtp_loss_scaling_factor: float = 0.1


def mtp_depths(cfg: ModelConfig) -> int:
    """The MTP depths of a model config (0 for a family without the keys)."""
    return int(getattr(cfg, "mtp_num_layers", 0) or 0)


def check_mtp_config(cfg: MegacannConfig, source: str) -> None:
    """``mtp_num_layers`` a non-negative integer below the sequence length, the scaling factor >= 0."""
    m = cfg.model
    if not hasattr(m, "mtp_num_layers"):
        return
    depths, scale = m.mtp_num_layers, m.mtp_loss_scaling_factor
    if isinstance(depths, bool) or not isinstance(depths, int) or depths < 0:
        raise ConfigError(f"{source}: model.mtp_num_layers must be an integer >= 0 (0: off), got {depths!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
        raise ConfigError(f"{source}: model.mtp_loss_scaling_factor must be a number >= 0, got {scale!r}")
    if depths and depths >= cfg.data.seq_length:
        raise ConfigError(
            f"{source}: model.mtp_num_layers {depths} leaves no target: depth k predicts the token k+1 ahead, "
            f"so it must be below data.seq_length {cfg.data.seq_length}"
        )


def mtp_parameters(cfg: ModelConfig, layer_parameters: int) -> int:
    """Parameters of the MTP depths: per depth its transformer layer (``layer_parameters``), three RMSNorms
    and the 2h -> h projection; the embedding and head are the model's."""
    h = cfg.hidden_size
    return mtp_depths(cfg) * (layer_parameters + 3 * h + 2 * h * h)


def mtp_matmul_parameters(cfg: ModelConfig, layer_matmul_parameters: int) -> int:
    """Weights that multiply each token in the MTP depths: per depth its layer's, the projection and the
    head (PaLM's N, for FLOPs)."""
    h = cfg.hidden_size
    return mtp_depths(cfg) * (layer_matmul_parameters + 2 * h * h + (cfg.vocab_size or 0) * h)
