"""The ``rl`` section (``train_mode: grpo``, docs/rl.md): every key checked before anything is built."""

from __future__ import annotations

import math

from megacann.config.schema import ConfigError, MegacannConfig


def reference_kind(cfg: MegacannConfig) -> str:
    """What the KL's reference policy is: ``none``, ``copy`` or ``adapters_off`` (``auto`` resolved)."""
    kind = cfg.rl.reference
    if kind == "auto":
        return "none" if cfg.rl.kl_coef == 0 else ("adapters_off" if cfg.lora else "copy")
    return kind


def update_phase_steps(cfg: MegacannConfig) -> int:
    """Optimizer steps one rollout phase feeds: ``ppo_epochs x mini_batches``."""
    return cfg.rl.ppo_epochs * cfg.rl.mini_batches


def training_forward_is_old_policy(cfg: MegacannConfig) -> bool:
    """Whether a step's training forward computes the old policy's log-probabilities itself: one optimizer
    step per rollout phase (``rl.ppo_epochs`` 1, ``rl.mini_batches`` 1), so no update lies between the
    rollout and the training forward, and no dropout, so the training forward (train mode) gives what the
    forward-only pass (eval mode) would. Router replay, the reference and pipeline stages change nothing:
    the training forward replays the routes as the pass would, the reference has its own pass, and the
    loss (the only reader) is on the last stage with the training forward."""
    r, m = cfg.rl, cfg.model
    dropout = m.hidden_dropout or m.attention_dropout or (cfg.lora and cfg.lora_dropout)
    return r.ppo_epochs == 1 and r.mini_batches == 1 and not dropout


def _number(value, key: str, source: str, low: float, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (strict and value == low):
        bound = f"> {low}" if strict else f">= {low}"
        raise ConfigError(f"{source}: rl.{key} must be a finite number {bound}, got {value!r}")


def _integer(value, key: str, source: str, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{source}: rl.{key} must be an integer >= {low}, got {value!r}")


def _check_router_replay(cfg: MegacannConfig, source: str) -> None:
    """``rl.router_replay`` is a boolean (any recomputation replays too: the recomputed blocks reuse the
    forward's recorded choices)."""
    if not isinstance(cfg.rl.router_replay, bool):
        raise ConfigError(f"{source}: rl.router_replay must be true or false, got {cfg.rl.router_replay!r}")


def check_rl_section(cfg: MegacannConfig, source: str) -> None:
    """``train_mode: grpo``: a prompts file, groups that fit the micro-batches, sampling, clipping, KL and
    dynamic-sampling settings that mean something."""
    if cfg.train_mode != "grpo":
        return
    r = cfg.rl
    if not r.prompts or not isinstance(r.prompts, str):
        raise ConfigError(f"{source}: train_mode grpo needs rl.prompts: a JSONL file of prompt or messages records")
    _integer(r.group_size, "group_size", source, 2)
    rows = cfg.data.batch_size * cfg.optim.grad_accum_steps
    if rows % r.group_size:
        raise ConfigError(
            f"{source}: data.batch_size x optim.grad_accum_steps ({rows}) must be a multiple of rl.group_size "
            f"{r.group_size}: each data-parallel rank trains whole groups"
        )
    _integer(r.max_new_tokens, "max_new_tokens", source, 1)
    _number(r.temperature, "temperature", source, 0.0, strict=True)
    _number(r.top_p, "top_p", source, 0.0, strict=True)
    if r.top_p > 1:
        raise ConfigError(f"{source}: rl.top_p must be in (0, 1] (1: off), got {r.top_p!r}")
    _integer(r.top_k, "top_k", source, 0)
    for key in ("clip_low", "clip_high", "kl_coef", "overlong_penalty"):
        _number(getattr(r, key), key, source, 0.0)
    if r.clip_low >= 1:
        raise ConfigError(
            f"{source}: rl.clip_low must be below 1 (the ratio's floor is 1 - clip_low), got {r.clip_low}"
        )
    if r.clip_high < r.clip_low:
        raise ConfigError(
            f"{source}: rl.clip_high {r.clip_high} is below rl.clip_low {r.clip_low}: reversed? the ratio is clipped "
            "to [1 - clip_low, 1 + clip_high] and clip-higher (DAPO) raises clip_high"
        )
    _integer(r.ppo_epochs, "ppo_epochs", source, 1)
    _integer(r.mini_batches, "mini_batches", source, 1)
    kind = reference_kind(cfg)
    if kind == "adapters_off" and not cfg.lora:
        raise ConfigError(f"{source}: rl.reference adapters_off needs lora: true (the base under the adapters)")
    if cfg.rl.kl_coef > 0 and kind == "none":
        raise ConfigError(f"{source}: rl.kl_coef {r.kl_coef} needs a reference policy, but rl.reference is none")
    if r.tis_cap is not None:
        _number(r.tis_cap, "tis_cap", source, 0.0, strict=True)
    _integer(r.filter_max_rounds, "filter_max_rounds", source, 0)
    _integer(r.overlong_buffer, "overlong_buffer", source, 0)
    if r.overlong_buffer >= r.max_new_tokens:
        raise ConfigError(
            f"{source}: rl.overlong_buffer {r.overlong_buffer} must be below rl.max_new_tokens {r.max_new_tokens}"
        )
    _check_router_replay(cfg, source)
    if not isinstance(r.filter_groups, bool):
        raise ConfigError(f"{source}: rl.filter_groups must be true or false, got {r.filter_groups!r}")
