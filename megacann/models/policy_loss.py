"""The policy-gradient objective of reinforcement learning on rollouts (GRPO, DAPO, GSPO, Dr. GRPO) on top of
any family's per-token loss, and the per-token log-probability pass that gives it the old and reference
policies' values.

A micro-batch of rollouts holds what an SFT one does (``tokens``, ``position_ids``, ``labels`` with the
ignore index on prompt and padding: the response mask ``m``) plus ``advantages`` ``[b]`` (one per response),
``old_logps`` ``[b, s]`` (each label's log-probability under the policy that sampled, aligned with
``labels``, 0 where masked) and, optionally, ``ref_logps`` ``[b, s]`` (KL) and ``rollout_logps`` ``[b, s]``
(the generator's own values: the mismatch figures and truncated importance sampling). The model's last
chunk returns ``-log pi`` of each label; with ``lp`` that, ``old`` / ``ref`` / ``roll`` the inputs and
``A`` the sequence's advantage, per response token:

- ratio ``r = exp(lp - old)`` (``ratio_level: token``), or GSPO's sequence ratio (``sequence``), the
  geometric mean of the token ratios over the response, ``s = exp(mean_t (lp - old))``, used in its
  token form ``r = exp(lp - sg(lp) + sg(log s))`` (value ``s``, gradient ``s * grad lp``: the same gradient
  as the sequence form under every aggregation); log-ratios are clamped to [-20, 20];
- ``pg = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` (PPO's clipped surrogate; ``clip_high >
  clip_low`` is DAPO's clip-higher);
- with ``tis_cap``, ``pg *= w``, ``w = min(exp(old - roll), tis_cap)`` detached (truncated importance
  sampling: corrects the generator / trainer mismatch);
- ``kl``: ``k1 = lp - ref`` or ``k3 = exp(ref - lp) - (ref - lp) - 1`` (Schulman's unbiased, positive
  estimator); the token's loss is ``pg + kl_coef * kl``.

``loss_aggregation`` decides how token losses make the step's loss: ``token_mean``, the sum over every
response token of the global batch over their number; ``seq_mean_token_mean``, each sequence's mean over its
tokens, then the mean over the global batch's sequences; ``seq_mean_token_sum``, each sequence's sum, then
the mean over sequences (Dr. GRPO's length-unbiased choice). The chunk returns each token's loss times
``1 / n_seq`` (the second) or 1, and the trainer divides the global sum by :func:`count_policy_normalizer`
(tokens or sequences), so micro-batches and data-parallel ranks give the one-process loss. Under context
parallelism a sequence's token count and GSPO's mean log-ratio are summed over the cp group first.

Figures (:func:`policy_figures`): ``pg_loss`` and ``kl`` aggregated as the loss; ``entropy`` of the policy's
distribution at response tokens (vocabulary-parallel, no gradient: one extra head product per response
token, :data:`ENTROPY_ROWS` tokens at a time); ``clip_frac_low`` / ``clip_frac_high``, the share of
response tokens whose clip is active (``A < 0, r < 1 - clip_low`` / ``A > 0, r > 1 + clip_high``); with
rollout log-probabilities ``logp_diff_mean`` / ``logp_diff_max`` of ``|lp - roll|`` and ``tis_weight_mean``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megacann import ops
from megacann import parallel_state as ps
from megacann.collectives import all_reduce_if_parallel
from megacann.constants import IGNORE_INDEX
from megacann.layers.context_parallel import context_parallel_gather
from megacann.layers.loss import vocab_parallel_entropy
from megacann.layers.mappings import gather_from_sequence_parallel_region
from megacann.layers.output import LMHead
from megacann.models.contract import ChunkOutput, count_target_tokens

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k3")
STAT_NAMES = (
    "tokens",
    "sequences",
    "pg_loss",
    "kl",
    "kl_tokens",
    "entropy",
    "entropy_tokens",
    "clipped_low",
    "clipped_high",
    "logp_diff",
    "tis_weight",
    "rollout_tokens",
)
LOG_RATIO_BOUND = 20.0
ENTROPY_ROWS = 1024  # response tokens whose logits the entropy figure holds at once


def _over_context_parallel(x: torch.Tensor) -> torch.Tensor:
    """``x`` (detached per-sequence sums) summed over the context-parallel group."""
    return all_reduce_if_parallel(
        x, ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None
    )


@dataclass(frozen=True)
class PolicyLoss:
    """A clipped policy-gradient objective (see the module's formulas): clip range ``[1 - clip_low, 1 +
    clip_high]``, ``ratio_level`` of :data:`RATIO_LEVELS`, ``loss_aggregation`` of :data:`AGGREGATIONS`,
    ``kl_coef`` with ``kl_estimator`` of :data:`KL_ESTIMATORS`, ``tis_cap`` (None: no importance weights)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    ratio_level: str = "token"
    loss_aggregation: str = "token_mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    tis_cap: Optional[float] = None

    def __post_init__(self):
        for name, allowed in (
            ("ratio_level", RATIO_LEVELS),
            ("loss_aggregation", AGGREGATIONS),
            ("kl_estimator", KL_ESTIMATORS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"rl.{name} {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"rl.clip_low {self.clip_low} must be in [0, 1) (the ratio's floor is 1 - clip_low)")
        if not self.clip_high >= 0.0:
            raise ValueError(f"rl.clip_high {self.clip_high} must be >= 0 (the ratio's ceiling is 1 + clip_high)")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"rl.kl_coef {self.kl_coef} must be >= 0")
        if self.tis_cap is not None and not self.tis_cap > 0.0:
            raise ValueError(f"rl.tis_cap {self.tis_cap} must be > 0 (or null: no importance sampling)")

    @classmethod
    def from_config(cls, rl: Any) -> PolicyLoss:
        """From the recipe's ``rl`` section: any object (or dict) with these names; absent ones keep their
        defaults."""
        if isinstance(rl, dict):
            return cls(**{f.name: rl[f.name] for f in fields(cls) if f.name in rl})
        return cls(**{f.name: getattr(rl, f.name) for f in fields(cls) if hasattr(rl, f.name)})

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0.0

    def ratio(self, logps: torch.Tensor, old: torch.Tensor, maskf: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each token's importance ratio ``[b, s]``: its own (``token``) or its sequence's geometric mean in
        the token form (``sequence``, GSPO); ``counts``: each whole sequence's response tokens."""
        log_ratio = (logps - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        if self.ratio_level == "sequence":
            mean_log_ratio = _over_context_parallel((log_ratio.detach() * maskf).sum(-1)) / counts.clamp(min=1.0)
            log_ratio = logps - logps.detach() + mean_log_ratio.unsqueeze(-1)
        return log_ratio.exp()

    def kl(self, logps: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """Each token's KL estimate to the reference: ``k1`` or ``k3`` (log-ratios clamped as the ratio's)."""
        delta = (ref - logps).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return -delta if self.kl_estimator == "k1" else delta.exp() - delta - 1.0

    def __call__(
        self,
        logps: torch.Tensor,
        old_logps: Optional[torch.Tensor],
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logps: Optional[torch.Tensor] = None,
        rollout_logps: Optional[torch.Tensor] = None,
        entropy: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token losses ``[b, s]`` weighted for the aggregation, 0 off the response; detached sums of
        :data:`STAT_NAMES`) from the policy's log-probabilities ``logps`` ``[b, s]`` and a micro-batch's
        values. ``old_logps`` None: the policy being trained is the old one (one update per rollout phase),
        so ``sg(logps)`` stands for it: ratio 1 in value, the same gradient. Under context parallelism the
        inputs are this rank's share of the tokens."""
        mask = mask.bool()
        maskf = mask.to(torch.float32)
        logps = torch.where(mask, logps.float(), 0.0)
        old = logps.detach() if old_logps is None else torch.where(mask, old_logps.float(), 0.0)
        counts = _over_context_parallel(maskf.sum(-1))  # response tokens of each whole sequence
        ratio = self.ratio(logps, old, maskf, counts)
        adv = advantages.to(torch.float32).unsqueeze(-1)
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high))
        clipped_low = mask & (adv < 0) & (ratio.detach() < 1.0 - self.clip_low)
        clipped_high = mask & (adv > 0) & (ratio.detach() > 1.0 + self.clip_high)

        zero = torch.zeros((), dtype=torch.float32, device=logps.device)
        logp_diff = tis_sum = rollout_tokens = zero
        if rollout_logps is not None:
            rollout = torch.where(mask, rollout_logps.float(), 0.0)
            logp_diff = ((logps.detach() - rollout).abs() * maskf).sum()
            rollout_tokens = maskf.sum()
        if self.tis_cap is not None:
            if rollout_logps is None:
                raise ValueError("rl.tis_cap needs the rollout's log-probabilities (rollout_logps) in each micro-batch")
            weight = (old - rollout).exp().clamp(max=self.tis_cap).detach()
            pg = pg * weight
            tis_sum = (weight * maskf).sum()

        if self.loss_aggregation == "seq_mean_token_mean":
            token_weight = (1.0 / counts.clamp(min=1.0)).unsqueeze(-1) * maskf
        else:
            token_weight = maskf
        loss = pg
        kl_sum = kl_tokens = zero
        if ref_logps is not None:
            kl = self.kl(logps, torch.where(mask, ref_logps.float(), 0.0))
            if self.kl_coef:
                loss = loss + self.kl_coef * kl
            kl_sum, kl_tokens = (kl.detach() * token_weight).sum(), maskf.sum()
        elif self.needs_reference:
            raise ValueError("rl.kl_coef > 0 needs the reference policy's log-probabilities (ref_logps)")
        entropy_sum = entropy_tokens = zero
        if entropy is not None:
            entropy_sum, entropy_tokens = (entropy.float() * maskf).sum(), maskf.sum()
        sequences = (counts > 0).float().sum() / ps.get_context_parallel_world_size()  # cp ranks share them
        stats = torch.stack(
            [
                maskf.sum(),
                sequences,
                (pg.detach() * token_weight).sum(),
                kl_sum,
                kl_tokens,
                entropy_sum,
                entropy_tokens,
                clipped_low.float().sum(),
                clipped_high.float().sum(),
                logp_diff,
                tis_sum,
                rollout_tokens,
            ]
        )
        return loss * token_weight, stats


@torch.no_grad()
def response_entropy(head: LMHead, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The policy's entropy ``[b, s]`` (fp32) at the response tokens of ``labels``, 0 elsewhere, from the
    head's input ``hidden`` (``[b, s/tp, h]`` under sequence parallelism): the logits of
    :data:`ENTROPY_ROWS` response tokens at a time, so the figure never holds a micro-batch's logits (the
    fused head loss does not either)."""
    if head.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, head.group)
    mask = labels != IGNORE_INDEX
    rows = hidden[mask]
    values = [
        vocab_parallel_entropy(
            ops.linear(rows[i : i + ENTROPY_ROWS], head.output_weight, None), head.vocab_size, head.group
        )
        for i in range(0, rows.shape[0], ENTROPY_ROWS)
    ]
    out = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    if values:
        out[mask] = torch.cat(values)
    return out


def _head(chunk: torch.nn.Module) -> Optional[LMHead]:
    """The chunk's language-model head (the last stage's), or None."""
    return next((m for m in chunk.modules() if isinstance(m, LMHead)), None)


def _required(batch: dict, key: str) -> torch.Tensor:
    if key not in batch:
        raise ValueError(f"a policy-gradient micro-batch needs {key!r} (it has: {', '.join(sorted(batch))})")
    return batch[key]


def policy_forward_step(
    forward_step: Callable, loss: PolicyLoss, max_sink: Optional[list] = None, old_from_forward: bool = False
) -> Callable[[torch.nn.Module, dict, Optional[torch.Tensor]], ChunkOutput]:
    """``forward_step`` whose last chunk returns the policy objective's weighted token losses (as
    ``token_loss``) and its sums (``stats["policy"]``, :data:`STAT_NAMES`); the entropy is taken from the
    head's input when the chunk has an :class:`~megacann.layers.output.LMHead`. ``max_sink`` (a list)
    receives each micro-batch's largest ``|lp - roll|`` for :func:`policy_figures`. With
    ``old_from_forward`` a micro-batch without ``old_logps`` takes this forward's own detached
    log-probabilities as the old policy's (the caller's promise: no update since the rollout); without it,
    such a micro-batch is an error."""

    def step(chunk: torch.nn.Module, batch: dict, hidden_states: Optional[torch.Tensor]) -> ChunkOutput:
        head, entropies = _head(chunk), []

        def record_entropy(module: LMHead, args: tuple, kwargs: dict) -> None:
            """The entropy at the head's input, while its weight is at hand (ZeRO-3 frees it after the
            forward); only the model's own head call (multi-token prediction calls it again)."""
            labels = args[1] if len(args) > 1 else kwargs.get("labels")
            if not entropies and labels is not None:
                entropies.append(response_entropy(module, args[0], labels))

        hook = head.register_forward_pre_hook(record_entropy, with_kwargs=True) if head is not None else None
        try:
            out = forward_step(chunk, batch, hidden_states)
        finally:
            if hook is not None:
                hook.remove()
        if out.token_loss is None:
            return out
        labels = batch["labels"]
        entropy = entropies[0] if entropies and entropies[0].shape == labels.shape else None
        rollout = batch.get("rollout_logps")
        old = batch.get("old_logps") if old_from_forward else _required(batch, "old_logps")
        token_loss, stats = loss(
            -out.token_loss,
            old,
            _required(batch, "advantages"),
            labels != IGNORE_INDEX,
            batch.get("ref_logps"),
            rollout,
            entropy,
        )
        if max_sink is not None and rollout is not None:
            diff = torch.where(labels != IGNORE_INDEX, (out.token_loss.detach() + rollout.float()).abs(), 0.0)
            max_sink.append(diff.max() if diff.numel() else torch.zeros((), device=diff.device))
        return ChunkOutput(token_loss=token_loss, aux_losses=out.aux_losses, stats={**out.stats, "policy": stats})

    return step


def token_logps_forward_step(forward_step: Callable, sink: list) -> Callable:
    """``forward_step`` of a log-probability pass (the old or the reference policy, under ``no_grad``): the
    last chunk appends each micro-batch's per-token log-probabilities of its labels ``[b, s]`` (fp32,
    detached, 0 where masked; whole sequences, gathered over context parallelism) to ``sink`` in
    micro-batch order, and returns a zero loss."""

    def step(chunk: torch.nn.Module, batch: dict, hidden_states: Optional[torch.Tensor]) -> ChunkOutput:
        out = forward_step(chunk, batch, hidden_states)
        if out.token_loss is None:
            return out
        logps = -out.token_loss.detach().float()
        sink.append(context_parallel_gather(logps, dim=1) if ps.get_context_parallel_world_size() > 1 else logps)
        return ChunkOutput(token_loss=torch.zeros(logps.shape[0], device=logps.device))

    return step


def count_policy_normalizer(micro_batches: list[dict], loss_aggregation: str, group=None) -> torch.Tensor:
    """What the step's loss is a mean over, summed over ``group`` (data parallel): response tokens
    (``token_mean``) or sequences with at least one response token (the ``seq_mean_*`` aggregations). A
    1-element fp32 tensor."""
    if loss_aggregation == "token_mean":
        return count_target_tokens(micro_batches, group)
    if loss_aggregation not in AGGREGATIONS:
        raise ValueError(f"rl.loss_aggregation {loss_aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
    rows = sum(((mb["labels"] != IGNORE_INDEX).any(-1)).sum() for mb in micro_batches)
    return all_reduce_if_parallel(rows.to(torch.float32).reshape(1), group)


def policy_figures(
    figures: dict[str, torch.Tensor], loss: PolicyLoss, max_sink: Optional[list] = None
) -> dict[str, torch.Tensor]:
    """A step's reduced figures with the summed ``policy`` stats turned into the logged ones (see the
    module), without reading the device: ``kl`` when ``loss`` needs a reference, ``tis_weight_mean`` with
    ``tis_cap``, and, when the caller tracks the rollout mismatch (``max_sink``, the list given to
    :func:`policy_forward_step`), ``logp_diff_mean`` and ``logp_diff_max``, the largest over every rank
    (an all-reduce: every rank calls this; the sink is emptied). ``loss`` is already the aggregated loss;
    ``entropy`` is 0 for a model without an :class:`~megacann.layers.output.LMHead`."""
    out = dict(figures)
    stats = out.pop("policy", None)
    if stats is None:
        return out
    s = dict(zip(STAT_NAMES, stats))
    tokens = s["tokens"].clamp(min=1.0)
    unit = tokens if loss.loss_aggregation == "token_mean" else s["sequences"].clamp(min=1.0)
    out["pg_loss"] = s["pg_loss"] / unit
    out["response_tokens"], out["sequences"] = s["tokens"], s["sequences"]
    out["clip_frac_low"], out["clip_frac_high"] = s["clipped_low"] / tokens, s["clipped_high"] / tokens
    out["entropy"] = s["entropy"] / s["entropy_tokens"].clamp(min=1.0)
    if loss.needs_reference:
        out["kl"] = s["kl"] / unit
    if loss.tis_cap is not None:
        out["tis_weight_mean"] = s["tis_weight"] / s["rollout_tokens"].clamp(min=1.0)
    if max_sink is not None:
        out["logp_diff_mean"] = s["logp_diff"] / s["rollout_tokens"].clamp(min=1.0)
        largest = torch.stack(max_sink).max().reshape(1) if max_sink else torch.zeros(1, device=stats.device)
        max_sink.clear()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        out["logp_diff_max"] = largest[0]
    return out
