"""Preference losses (DPO, conservative DPO, IPO, SimPO) on top of any family's per-token loss.

A micro-batch of preference data holds whole pairs, chosen then rejected (rows ``2k`` and ``2k + 1``; see
:mod:`megacann.data.preference_dataset`). The model's last chunk returns its per-token cross entropy
(``-log p`` of each label, 0 where no label); a sequence's log-probability is minus its sum over the
response. :func:`preference_forward_step` wraps a family's ``forward_step`` so the last chunk returns, in
place of token losses, one loss per pair (and rewards as stats); the schedules, gradient reduction and
optimizers are the pretraining ones. The step's objective is the mean over the pairs of the global batch
(the trainer's loss normaliser counts pairs: :func:`count_pairs`).

Under context parallelism each rank holds a share of every sequence's tokens: the shares' sums are
all-reduced over the cp group (backward: identity, so each rank's tokens get the loss's gradient and the
cp gradient sum is the whole one), every cp rank computes the same pair losses, and the value it reports
is divided by the cp size (its gradient kept whole) so that sums over the dp x cp group count each pair
once. Tensor parallelism is inside the vocabulary-parallel cross entropy; pipeline parallelism keeps a
pair in one micro-batch, so the stage with the loss (the last; stage 0's chunk 1 in the V of ``zbv`` and
``dualpipev``) has both sides.

Losses, with ``pi = log pi(y|x)``, ``ref = log pi_ref(y|x)``, ``c`` / ``r`` chosen / rejected, ``n`` the
response length in tokens:

- ``sigmoid`` (DPO): ``-(1-e) logsig(b h) - e logsig(-b h)``, ``h = (pi_c - ref_c) - (pi_r - ref_r)``,
  ``e`` the label smoothing (conservative DPO); rewards ``b (pi - ref)``;
- ``ipo``: ``(h' - 1 / (2b))^2`` with ``h'`` as ``h`` on per-token means ``pi / n`` (as TRL); rewards on
  those means;
- ``simpo`` (reference-free): ``-(1-e) logsig(b (pi_c/n_c - pi_r/n_r) - g) - e logsig(-...)``,
  ``g`` = ``simpo_gamma``; rewards ``b pi / n``.

Any of them plus ``a * (-pi_c / n_c)`` with ``a`` = ``sft_loss_weight`` > 0: the chosen answer's mean
per-token negative log-likelihood (an SFT term, as in RPO), which keeps the chosen answers' likelihood
from falling while the margin grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megacann import parallel_state as ps
from megacann.collectives import all_reduce_if_parallel
from megacann.constants import IGNORE_INDEX
from megacann.layers.mappings import reduce_from_tensor_model_parallel_region
from megacann.models.contract import ChunkOutput

LOSS_TYPES = ("sigmoid", "ipo", "simpo")
STAT_NAMES = ("pairs", "chosen_reward_sum", "rejected_reward_sum", "correct_pairs")


@dataclass(frozen=True)
class PreferenceLoss:
    """A preference objective: ``loss_type`` one of :data:`LOSS_TYPES`, ``beta``, ``label_smoothing``
    (sigmoid, simpo), ``simpo_gamma`` and ``sft_loss_weight`` (the chosen answers' NLL term)."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    sft_loss_weight: float = 0.0

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")

    @classmethod
    def from_config(cls, dpo) -> PreferenceLoss:
        """From the recipe's ``dpo`` section."""
        return cls(dpo.loss_type, dpo.beta, dpo.label_smoothing, dpo.simpo_gamma, dpo.sft_loss_weight)

    @property
    def needs_reference(self) -> bool:
        return self.loss_type != "simpo"

    def __call__(
        self, policy: torch.Tensor, lengths: torch.Tensor, reference: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, chosen reward, rejected reward) per pair, from sequence log-probabilities ``[2n]`` (rows
        chosen, rejected, chosen, ...) of the policy and the reference, and response lengths ``[2n]``."""
        chosen_nll = -policy[0::2] / lengths[0::2]  # the SFT term's: mean over the chosen answer's tokens
        if self.loss_type in ("ipo", "simpo"):
            policy = policy / lengths
            reference = reference / lengths if reference is not None else None
        pc, pr = policy[0::2], policy[1::2]
        if self.loss_type == "simpo":
            rc = rr = torch.zeros_like(pc)
        elif reference is None:
            raise ValueError(f"loss_type {self.loss_type} needs the reference policy's log-probabilities")
        else:
            rc, rr = reference[0::2].to(pc.dtype), reference[1::2].to(pc.dtype)
        chosen, rejected = pc - rc, pr - rr
        b, e = self.beta, self.label_smoothing
        if self.loss_type == "ipo":
            loss = (chosen - rejected - 1.0 / (2.0 * b)) ** 2
        else:
            h = b * (chosen - rejected) - (self.simpo_gamma if self.loss_type == "simpo" else 0.0)
            loss = -(1.0 - e) * F.logsigmoid(h) - e * F.logsigmoid(-h)
        if self.sft_loss_weight:
            loss = loss + self.sft_loss_weight * chosen_nll
        return loss, (b * chosen).detach(), (b * rejected).detach()


def sequence_logps(token_loss: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability, number of response tokens) of each whole sequence, ``[b]`` fp32, from this rank's
    per-token losses and labels; summed over the context-parallel group (backward: identity)."""
    counts = (labels != IGNORE_INDEX).sum(-1).to(torch.float32)
    logps = -token_loss.float().sum(-1)
    group = ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None
    if group is not None:
        logps = reduce_from_tensor_model_parallel_region(logps, group=group)
        counts = all_reduce_if_parallel(counts, group)
    return logps, counts


def preference_forward_step(
    forward_step: Callable, objective: PreferenceLoss
) -> Callable[[torch.nn.Module, dict, Optional[torch.Tensor]], ChunkOutput]:
    """``forward_step`` whose last chunk returns per-pair losses (as ``token_loss``) and the rewards' sums
    (``stats``: pairs, chosen / rejected reward sums, correctly ordered pairs). The micro-batch carries the
    reference log-probabilities as ``ref_logps`` ``[b]`` when ``objective.needs_reference``."""

    def step(chunk: torch.nn.Module, batch: dict, hidden_states: Optional[torch.Tensor]) -> ChunkOutput:
        out = forward_step(chunk, batch, hidden_states)
        if out.token_loss is None:
            return out
        policy, lengths = sequence_logps(out.token_loss, batch["labels"])
        losses, chosen, rejected = objective(policy, lengths, batch.get("ref_logps"))
        share = 1.0 / ps.get_context_parallel_world_size()  # each cp rank holds the same pairs
        reported = losses * share + (losses - losses.detach()) * (1.0 - share)  # value / cp, gradient whole
        stats = torch.stack(
            [torch.ones_like(chosen).sum(), chosen.sum(), rejected.sum(), (chosen > rejected).float().sum()]
        )
        return ChunkOutput(
            token_loss=reported,
            aux_losses=out.aux_losses,
            stats={**out.stats, "preference": stats * share},
        )

    return step


def reference_forward_step(forward_step: Callable, sink: list) -> Callable:
    """``forward_step`` of a reference pass: the last chunk appends each micro-batch's sequence
    log-probabilities ``[b]`` (detached, fp32) to ``sink``, in micro-batch order, and returns a zero loss."""

    def step(chunk: torch.nn.Module, batch: dict, hidden_states: Optional[torch.Tensor]) -> ChunkOutput:
        out = forward_step(chunk, batch, hidden_states)
        if out.token_loss is None:
            return out
        logps, _ = sequence_logps(out.token_loss, batch["labels"])
        sink.append(logps.detach())
        return ChunkOutput(token_loss=torch.zeros_like(logps))

    return step


def count_pairs(micro_batches: list[dict], group=None) -> torch.Tensor:
    """Preference pairs in these micro-batches (half their rows), summed over ``group`` (data parallel):
    the normaliser of a preference step. A 1-element fp32 tensor."""
    rows = sum(mb["labels"].shape[0] for mb in micro_batches)
    device = micro_batches[0]["labels"].device
    return all_reduce_if_parallel(torch.tensor([rows / 2], dtype=torch.float32, device=device), group)


def preference_figures(figures: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A step's reduced figures with the summed ``preference`` stats turned into means over the pairs:
    ``chosen_reward``, ``rejected_reward``, ``reward_margin``, ``reward_accuracy`` (``loss`` is already the
    mean pair loss)."""
    out = dict(figures)
    stats = out.pop("preference", None)
    if stats is None:
        return out
    pairs = stats[0].clamp(min=1.0)
    out["chosen_reward"] = stats[1] / pairs
    out["rejected_reward"] = stats[2] / pairs
    out["reward_margin"] = (stats[1] - stats[2]) / pairs
    out["reward_accuracy"] = stats[3] / pairs
    return out
