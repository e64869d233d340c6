"""What a training step optimises, chosen by ``train_mode``: the trainer's one hook for it.

The trainer runs any objective the same way, calling every hook of :class:`Objective` (whose defaults
do nothing): :meth:`~Objective.prepare` completes the step's micro-batches (DPO: the reference policy's
log-probabilities), :meth:`~Objective.count` is the global normaliser of the loss, the family's
``forward_step`` (possibly wrapped) runs in the schedule, :meth:`~Objective.figures` turns the reduced sums
into the logged figures, :meth:`~Objective.evaluate` scores held-out batches, and
:meth:`~Objective.checkpoint_state` / :meth:`~Objective.restore_state` carry the objective's own state in
checkpoints. :class:`TokenObjective` is pretraining's and SFT's per-token loss; ``train_mode: dpo`` gets
:class:`~megacann.training.preference.PreferenceTraining` and ``train_mode: grpo``
:class:`~megacann.training.rl.RLTraining`, whose :meth:`prepare` replaces the step's micro-batches by rollouts,
whose ``data_factory`` is the trainer's data (a step counter) and whose checkpoints carry a phase's rollouts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

from megacann import parallel_state as ps
from megacann.config import MegacannConfig
from megacann.models import ModelSpec
from megacann.models.contract import count_target_tokens


class Objective:
    """The hooks the trainer calls on every objective, each a no-op unless the objective overrides it; an
    objective sets ``forward_step`` (what the schedule runs) and defines :meth:`count` and :meth:`evaluate`."""

    forward_step: Callable
    # the trainer's data, made by the objective from ``consumed_samples`` (GRPO: a step counter); None: the
    # recipe's data
    data_factory: Optional[Callable[[int], Any]] = None

    def describe(self) -> Optional[str]:
        """A line for the run's opening lines, or None (nothing to add)."""
        return None

    def prepare(self, micro_batches: list[dict], data) -> None:
        """Complete the step's micro-batches in place (by default nothing: they hold what the forward step
        reads)."""

    def count(self, micro_batches: list[dict]) -> torch.Tensor:
        """The loss's normaliser over the whole global batch, a device tensor."""
        raise NotImplementedError

    def figures(self, figures: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The step's logged figures from the reduced sums (by default those sums)."""
        return figures

    def evaluate(self, batches: Iterator[dict], forward_backward, data) -> Optional[dict[str, float]]:
        """Held-out figures over ``batches``, or None."""
        raise NotImplementedError

    def checkpoint_state(self) -> Any:
        """This rank's state of the objective that a checkpoint must carry (picklable), or None (nothing)."""
        return None

    def restore_state(self, state: Any) -> None:
        """Take back what :meth:`checkpoint_state` saved (None: the checkpoint holds nothing of it)."""


class TokenObjective(Objective):
    """Pretraining and SFT: the mean of the family's per-token loss over the global batch's target tokens."""

    def __init__(self, cfg: MegacannConfig, spec: ModelSpec, policy: list[torch.nn.Module]):
        self.cfg, self.policy = cfg, policy
        self.forward_step = spec.forward_step

    def count(self, micro_batches: list[dict]) -> torch.Tensor:
        """Target tokens in the whole global batch (every data-parallel rank's micro-batches). The batches
        hold whole sequences (the cp ranks of one data-parallel rank read the same samples; the schedule
        hands each its share), so counting them over the data-parallel group counts every token once."""
        return count_target_tokens(micro_batches, ps.get_data_parallel_group())

    @torch.no_grad()
    def evaluate(self, batches: Iterator[dict], forward_backward, data) -> Optional[dict[str, float]]:
        """Loss and perplexity over ``logging.eval_iters`` held-out global batches (``batches``: this rank's
        held-out micro-batches, on the device), or None when there is no target token."""
        total_loss, total_tokens = 0.0, 0.0
        for _ in range(self.cfg.logging.eval_iters):
            micro_batches = list(itertools.islice(batches, self.cfg.optim.grad_accum_steps))
            if len(micro_batches) < self.cfg.optim.grad_accum_steps:
                break
            num_tokens = self.count(micro_batches)
            totals = forward_backward(self.policy, micro_batches, loss_normalizer=1.0, forward_only=True)
            total_loss += float(totals.reduce(num_tokens)["loss"]) * num_tokens.item()
            total_tokens += num_tokens.item()
        if total_tokens == 0:
            return None
        loss = total_loss / total_tokens
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


def build_objective(
    cfg: MegacannConfig, spec: ModelSpec, policy: list[torch.nn.Module], device, tokenizer=None
) -> Objective:
    """The objective of ``train_mode``: DPO's (with its reference policy), GRPO's (rollouts of the policy
    itself, scored with ``tokenizer``'s text) or the per-token one."""
    if cfg.train_mode == "grpo":
        from megacann.training.rl import RLTraining

        return RLTraining(cfg, spec, policy, device, tokenizer)
    if cfg.train_mode == "dpo":
        from megacann.training.preference import PreferenceTraining

        return PreferenceTraining(cfg, spec, policy, device)
    return TokenObjective(cfg, spec, policy)
