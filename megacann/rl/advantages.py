"""Advantages of a batch of rollouts from their rewards, one per response, for GRPO-family training.

Rewards come as ``[groups, group_size]``: row ``g`` holds the scores of the ``group_size`` responses sampled
for prompt ``g``. With ``r`` a row, ``G`` its size and ``eps`` a guard against a zero spread:

- ``grpo``: ``A = (r - mean(r)) / (std + eps)``, where ``std`` is the row's standard deviation
  (``scale_rewards: group``, GRPO as in DeepSeekMath), that of every reward of the batch (``batch``), or
  ``1`` (``none``: Dr. GRPO, which drops the scaling as a source of bias towards easy and hard prompts).
  Standard deviations use Bessel's correction (divide by ``n - 1``), as ``torch.std`` does.
- ``rloo``: ``A_i = r_i - (sum(r) - r_i) / (G - 1)``, the reward minus the mean of the other members
  (leave-one-out baseline); not scaled.

A group whose rewards are all equal gets zero advantages under every estimator (no learning signal: the
reason dynamic sampling drops such groups).
"""

from __future__ import annotations

import torch

ESTIMATORS = ("grpo", "rloo")
REWARD_SCALINGS = ("group", "batch", "none")


def compute_advantages(
    rewards: torch.Tensor, estimator: str = "grpo", scale_rewards: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """Advantages ``[groups, group_size]`` (float32) of rewards ``[groups, group_size]`` (see the module's
    formulas). A group needs at least two members: a baseline from one sample is the sample itself."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r} is not one of {', '.join(ESTIMATORS)}")
    if scale_rewards not in REWARD_SCALINGS:
        raise ValueError(f"scale_rewards {scale_rewards!r} is not one of {', '.join(REWARD_SCALINGS)}")
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, group_size] with group_size >= 2, got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.float32)
    size = r.shape[1]
    if estimator == "rloo":
        return r - (r.sum(dim=1, keepdim=True) - r) / (size - 1)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale_rewards == "none":
        return centred
    std = r.std(dim=1, keepdim=True) if scale_rewards == "group" else r.std()
    return centred / (std + eps)
