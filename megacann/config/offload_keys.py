"""The offload keys: ``optim.offload_optimizer`` and ``training.activation_offload_layers`` (docs/zero.md#offload).

Checked here so that a recipe asking for an offload megacann cannot do is refused before anything is built,
naming the key, the value and what was expected.
"""

from __future__ import annotations

from megacann.config.schema import ConfigError, MegacannConfig

ACTIVATION_OFFLOAD_KEY = "training.activation_offload_layers"


def offloaded_layer_ids(cfg: MegacannConfig) -> list[int]:
    """Global indices of the transformer layers whose saved activations go to host memory, sorted: the first
    N layers for an integer N (they wait longest for their backward), or the listed ones."""
    value = cfg.training.activation_offload_layers
    if isinstance(value, int) and not isinstance(value, bool):
        return list(range(value))
    return sorted(value)


def check_offload_keys(cfg: MegacannConfig, source: str) -> None:
    if not isinstance(cfg.optim.offload_optimizer, bool):
        raise ConfigError(
            f"{source}: optim.offload_optimizer must be true or false, got {cfg.optim.offload_optimizer!r}"
        )
    value = cfg.training.activation_offload_layers
    layers = cfg.model.num_layers
    where = f"{source}: {ACTIVATION_OFFLOAD_KEY}"
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise ConfigError(f"{where} must be a number of layers or a list of layer indices, got {value!r}")
    if isinstance(value, int):
        if value < 0 or (layers is not None and value > layers):
            raise ConfigError(f"{where} must be between 0 and model.num_layers ({layers}), got {value}")
    else:
        bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (layers and v >= layers)]
        if bad or len(set(value)) != len(value):
            raise ConfigError(
                f"{where}: expected distinct layer indices in [0, {layers}), got {value!r}"
                + (f" ({bad} out of range)" if bad else " (repeated)")
            )
    if not offloaded_layer_ids(cfg):
        return
    if cfg.model.activation_checkpointing == "full":
        raise ConfigError(
            f"{where} cannot be used with model.activation_checkpointing 'full': a fully recomputed layer keeps "
            "only its input, held by the checkpoint outside autograd's saved tensors, so there is nothing to offload "
            "(use 'selective' or 'none' with it)"
        )
    if cfg.precision.compile:
        raise ConfigError(
            f"{where} is not supported with precision.compile: compiled blocks save their tensors inside the "
            "compiled graph, out of reach of the offload hooks (set precision.compile: false)"
        )
