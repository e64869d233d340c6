"""The ``precision.fp8*`` keys: what FP8 products cannot run beside yet, refused by name (docs/ops.md,
"Training in FP8")."""

from __future__ import annotations

from megacann.config.schema import ConfigError, MegacannConfig

# the recipes that scale a weight gradient's operands in 1 x N tiles along the tokens (megacann.ops.fp8_formats)
FP8_TOKEN_TILES = {"blockwise": 128, "mxfp8": 32}


def check_fp8_keys(cfg: MegacannConfig, source: str) -> None:
    """``precision.fp8`` with what its products cannot run beside yet, refused by name."""
    if cfg.precision.fp8 == "none":
        return
    d = cfg.distributed
    tile = FP8_TOKEN_TILES.get(cfg.precision.fp8)
    chunk = cfg.data.seq_length // (2 * d.context_parallel_size)
    if d.context_parallel_size > 1 and tile is not None and chunk % tile:
        raise ConfigError(
            f"{source}: precision.fp8={cfg.precision.fp8} with distributed.context_parallel_size "
            f"{d.context_parallel_size} needs each of the sequence's {2 * d.context_parallel_size} chunks to hold "
            f"whole {tile}-token tiles, but data.seq_length {cfg.data.seq_length} gives chunks of {chunk}"
        )
    if cfg.precision.fp8_scaling == "delayed" and cfg.precision.fp8 != "tensorwise":
        raise ConfigError(
            f"{source}: precision.fp8_scaling=delayed takes precision.fp8=tensorwise, not {cfg.precision.fp8!r}"
        )
