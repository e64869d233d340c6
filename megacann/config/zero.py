"""Checks of the ZeRO keys (``distributed.zero_optimization``, ``distributed.zero_shard_group_size``) once
the parallel sizes are known: every value either does what it says or is refused here, naming the key."""

from __future__ import annotations

from megacann.config.schema import ConfigError, MegacannConfig


def check_zero_keys(cfg: MegacannConfig, source: str) -> None:
    """Before the sizes are resolved: the values themselves."""
    d = cfg.distributed
    if d.zero_optimization not in (False, True, 0, 1, 2, 3):
        raise ConfigError(
            f"{source}: distributed.zero_optimization must be false, true, 1, 2 or 3, got {d.zero_optimization!r}"
        )
    k = d.zero_shard_group_size
    if k is None:
        return
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"{source}: distributed.zero_shard_group_size must be a positive integer, got {k!r}")
    if not d.zero_stage:
        raise ConfigError(
            f"{source}: distributed.zero_shard_group_size {k} shards ZeRO state within groups of ranks and needs "
            "distributed.zero_optimization 1, 2 or 3 (got false)"
        )


def check_zero_layout(cfg: MegacannConfig, source: str) -> None:
    """After the sizes are resolved: the shard group fits the data-parallel groups; stage 3's limits."""
    d = cfg.distributed
    if d.zero_stage == 3 and cfg.precision.compile not in (False, None):
        raise ConfigError(
            f"{source}: distributed.zero_optimization 3 gathers and frees weights in module hooks, which "
            f"precision.compile ({cfg.precision.compile!r}) would trace around: set precision.compile false or "
            "use zero_optimization 2"
        )
    k = d.zero_shard_group_size
    if k is None or d.data_parallel_size is None:
        return
    dense = d.data_parallel_size * d.context_parallel_size
    expert = dense // d.expert_parallel_size
    if dense % k or expert % k:
        what = f"data-parallel x context-parallel size {dense}"
        if d.expert_parallel_size > 1:
            what += f" and the expert-data-parallel x context-parallel size {expert}"
        raise ConfigError(
            f"{source}: distributed.zero_shard_group_size {k} must divide the {what} (each group of {k} ranks "
            "shards the state, the groups replicate it)"
        )
