"""``train_mode: grpo``: reinforcement learning on the model's own rollouts, inside the trainer.

The trainer runs this objective like pretraining's (:mod:`megacann.training.objective`); what differs is
:meth:`RLTraining.prepare`, which builds the step's micro-batches itself. A rollout phase feeds
``rl.ppo_epochs x rl.mini_batches`` optimizer steps; its first step:

1. takes ``mini_batches x global batch / group_size`` prompts (:class:`~megacann.rl.prompts.PromptOrder`:
   from the seed and the phase only), each data-parallel rank its contiguous share;
2. generates ``rl.group_size`` responses per prompt with the training model itself (colocated: the same
   weights, in eval mode, no copy), each response with its own seed, and scores them with ``rl.reward``
   (plus the overlong penalty); the rollouts are gathered over the data-parallel group, so every rank
   knows every reward;
3. with ``rl.filter_groups`` drops the groups whose rewards are all equal and samples further rounds until
   the phase is full (at most ``rl.filter_max_rounds``; then an error, or with ``filter_shortfall: fill`` the
   dropped groups complete it, counted in ``filter_filled_groups``);
4. computes the advantages over the phase's groups, packs each rank's share into micro-batches, and
   recomputes each response token's log-probability with the trainer (forward-only, eval mode): the old
   policy of the ratio, compared with the generator's (``logprob_mismatch_mean`` / ``_max``); the reference
   policy's the same way when the KL is on. A phase of one optimizer step without dropout skips the old
   policy's pass (:func:`~megacann.config.rl_keys.training_forward_is_old_policy`): the training
   forward's detached log-probabilities are the old policy's, and the mismatch figures come from that
   forward.

Then each step trains on mini-batch ``step % mini_batches`` of the phase. A checkpoint that falls inside a
phase saves this rank's micro-batches of it (:meth:`RLTraining.checkpoint_state`: tokens, labels,
advantages, the rollout's, old and reference log-probabilities, router choices) with the phase's figures,
so a run resumed there trains on the very rollouts the uninterrupted run did.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.checkpoint.metadata import describe_layout, layout_of
from megacann.config import MegacannConfig
from megacann.config.rl_keys import reference_kind, training_forward_is_old_policy, update_phase_steps
from megacann.constants import IGNORE_INDEX
from megacann.data.sft_templates import get_template
from megacann.generation import Generator
from megacann.layers.lora import adapters_disabled
from megacann.layers.moe.routing_replay import routers
from megacann.models import ModelSpec
from megacann.models.policy_loss import (
    PolicyLoss,
    count_policy_normalizer,
    policy_figures,
    policy_forward_step,
    token_logps_forward_step,
)
from megacann.pipeline import get_forward_backward_func
from megacann.rl.advantages import compute_advantages
from megacann.rl.prompts import PromptOrder, read_prompts
from megacann.rl.rewards import build_reward, score
from megacann.rl.rollout import (
    Rollout,
    gather_rollouts,
    generate_groups,
    overlong_penalty,
    replaying_forward_step,
    response_figures,
    rollout_micro_batches,
)
from megacann.training.objective import Objective
from megacann.training.preference import build_reference_copy, forward_only_pass


class FilterShortfall(RuntimeError):
    """Dynamic sampling could not fill a rollout phase within ``rl.filter_max_rounds`` extra rounds."""


class StepCounter:
    """The trainer's data for ``train_mode: grpo``: each micro-batch only says which step it belongs to
    (``rl_step``); the objective turns them into rollouts. No held-out split (``valid`` None)."""

    valid = None

    def __init__(self, first_step: int, micro_batches_per_step: int):
        self.train = self._steps(first_step, micro_batches_per_step)

    @staticmethod
    def _steps(step: int, per_step: int) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            for _ in range(per_step):
                yield {"rl_step": torch.tensor(step)}
            step += 1


class RLTraining(Objective):
    """The objective of ``train_mode: grpo`` (see the module docstring)."""

    def __init__(self, cfg: MegacannConfig, spec: ModelSpec, policy: list[torch.nn.Module], device, tokenizer):
        self.cfg, self.spec, self.policy, self.device = cfg, spec, policy, device
        self.loss = PolicyLoss.from_config(cfg.rl)
        self.largest_gaps: list[torch.Tensor] = []  # each micro-batch's largest |trainer - rollout| log-prob gap
        self.replay = bool(cfg.rl.router_replay)
        if self.replay:
            _check_routers(policy, cfg.model.type, device)
        # the policy's forwards (old log-probabilities and training) route as the rollout with router replay
        self.policy_step = replaying_forward_step(spec.forward_step, policy) if self.replay else spec.forward_step
        # one update per phase, no dropout: the training forward is the old policy, no recompute pass
        self.old_from_training = training_forward_is_old_policy(cfg)
        self.forward_step = policy_forward_step(self.policy_step, self.loss, self.largest_gaps, old_from_forward=True)
        self.schedule = get_forward_backward_func(cfg, spec.forward_step)
        self.kind = reference_kind(cfg)
        self.reference = build_reference_copy(cfg, spec, device) if self.kind == "copy" else None
        self.reward = build_reward(cfg.rl.reward, cfg.experiment.imports)
        room = cfg.data.seq_length - cfg.rl.max_new_tokens
        self.prompts = read_prompts(cfg.rl.prompts, tokenizer, get_template(cfg.data.prompt_template), room)
        self.order = PromptOrder(len(self.prompts), cfg.seed)
        self.decode = tokenizer.decode
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        # under context parallelism the cp ranks of a data-parallel rank each generate the same rollouts;
        # router replay reads one routing record a forward round (one micro-batch a round on pipeline stages)
        self.generator = Generator(
            policy,  # every chunk of this rank (interleaved pipeline chunks: all of them, in order)
            spec,
            eos_token_ids=[tokenizer.eos_id],
            pad_token_id=self.pad_id,
            context_parallel_replicas=True,
            num_microbatches=1 if self.replay else None,
            share_prompts=not self.replay,  # a group's responses share their prompt's prefill
        )
        self.phase: Optional[int] = None
        self.next_step = 0  # the step after the last one prepared
        self.mini_batches: list[list[dict]] = []  # this rank's micro-batches of each mini-batch of the phase
        self.phase_figures: dict[str, float] = {}
        self.train_started = 0.0

    def describe(self) -> str:
        r = self.cfg.rl
        what = {
            "none": "none",
            "copy": "a frozen copy of the starting weights",
            "adapters_off": "the frozen base (adapters disabled)",
        }
        return (
            f"reinforcement learning ({r.advantage_estimator}, scale_rewards {r.scale_rewards}): {len(self.prompts)} "
            f"prompts, {r.group_size} responses each, reward {r.reward}, clip [{r.clip_low}, {r.clip_high}], "
            f"kl_coef {r.kl_coef} (reference: {what[self.kind]}); rollouts by the training model itself"
            f"{self._layout_note()}"
        )

    def _layout_note(self) -> str:
        cp = ps.get_context_parallel_world_size()
        note = ", router replay on" if self.replay else ""
        if cp > 1:
            note += (
                f"; generation without context parallelism: each of the {cp} cp ranks of a data-parallel rank "
                "generates the same rollouts, training splits the sequences over them"
            )
        return note

    def data_factory(self, consumed_samples: int) -> StepCounter:
        """The step counter from the step ``consumed_samples`` reaches (whole global batches)."""
        return StepCounter(consumed_samples // self.cfg.global_batch_size, self.cfg.optim.grad_accum_steps)

    # -- the rollout phase -----------------------------------------------------------------------------
    def _score(self, rollouts: list[Rollout]) -> None:
        """Each rollout's ``raw_reward`` (``rl.reward`` of its text, the EOS left out) and ``reward`` (plus the
        overlong penalty)."""
        r = self.cfg.rl
        for rollout in rollouts:
            prompt = self.prompts[rollout.prompt]
            tokens = rollout.tokens[:-1] if rollout.finish_reason == "eos" else rollout.tokens
            rollout.raw_reward = score(self.reward, prompt.text, self.decode(tokens), prompt.record, prompt.where)
            penalty = overlong_penalty(len(rollout.tokens), r.max_new_tokens, r.overlong_buffer, r.overlong_penalty)
            rollout.reward = rollout.raw_reward + penalty

    def _score_on_last_stage(self, rollouts: list[Rollout]) -> None:
        """:meth:`_score` here, or on pipeline stages by the stage with the head alone (the reward runs once), its
        rewards then broadcast: every stage keeps and drops the same groups and builds the same micro-batches."""
        if ps.get_pipeline_model_parallel_world_size() == 1:
            self._score(rollouts)
            return
        stages = self.generator.stages  # the stage with the head: the last one, stage 0 in the V (zbv, dualpipev)
        if stages.last:
            self._score(rollouts)
        rewards = torch.tensor([[x.raw_reward, x.reward] for x in rollouts], dtype=torch.float64, device=self.device)
        dist.broadcast(rewards, stages.head_rank(), group=ps.get_pipeline_model_parallel_group())
        for rollout, (raw, reward) in zip(rollouts, rewards.tolist()):
            rollout.raw_reward, rollout.reward = raw, reward

    def _sample_groups(self, phase: int, need: int) -> tuple[list[list[Rollout]], dict[str, float]]:
        """``need`` groups for the phase (every rank gets all of them), and the sampling's figures."""
        r, size = self.cfg.rl, self.cfg.rl.group_size
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        share = need // dp
        kept: list[list[Rollout]] = []
        dropped: list[list[Rollout]] = []
        sampled: list[Rollout] = []
        rounds, rows = 0, self.cfg.data.batch_size * self.cfg.optim.grad_accum_steps
        for round_index in range(r.filter_max_rounds + 1 if r.filter_groups else 1):
            rounds += 1
            indices = self.order.step_prompts(phase, round_index, need)
            slots = list(enumerate(indices))[rank * share : (rank + 1) * share]
            mine = generate_groups(
                self.generator, self.prompts, slots, r, (self.cfg.seed, phase, round_index), rows, self.replay
            )
            self._score_on_last_stage(mine)
            everyone = gather_rollouts(mine, ps.get_data_parallel_group())
            sampled += everyone
            for first in range(0, len(everyone), size):
                group = everyone[first : first + size]
                equal = len({x.reward for x in group}) == 1
                (dropped if r.filter_groups and equal else kept).append(group)
            if len(kept) >= need:
                break
        shortfall = max(0, need - len(kept))
        if shortfall and r.filter_shortfall == "error":
            raise FilterShortfall(
                f"rl.filter_groups: {len(kept)} of the {need} groups the phase needs have rewards that differ after "
                f"{rounds} sampling rounds (rl.filter_max_rounds {r.filter_max_rounds}); raise it, or set "
                "rl.filter_shortfall: fill to complete the batch with all-equal groups (advantage 0)"
            )
        groups = (kept + dropped[:shortfall])[:need]
        rewards = torch.tensor([x.raw_reward for x in sampled], dtype=torch.float64)
        figures = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "reward_accuracy": float((rewards >= 1.0).double().mean()),
            "sampling_rounds": float(rounds),
            "filtered_groups": float(len(dropped)),
            "filter_filled_groups": float(shortfall),
            "rollout_tokens": float(sum(len(x.tokens) for x in sampled)),
            **response_figures(sampled),
        }
        return groups, figures

    @torch.no_grad()
    def _token_logps(self, micro_batches: list[dict], chunks, context, forward_step) -> Optional[list[torch.Tensor]]:
        """Per-token log-probabilities ``[b, s]`` of each micro-batch's labels under ``chunks`` (one
        forward-only pass of the step's schedule, eval mode); None on a pipeline stage that computes no loss
        (it needs none: only the loss reads them)."""
        sink: list[torch.Tensor] = []
        step = token_logps_forward_step(forward_step, sink)
        forward_only_pass(self.schedule, chunks, micro_batches, step, context)
        if not sink and ps.get_pipeline_model_parallel_world_size() > 1:
            return None
        if len(sink) != len(micro_batches):
            raise RuntimeError(f"log-probability pass: {len(sink)} results for {len(micro_batches)} micro-batches")
        return sink

    def _rollout_phase(self, phase: int) -> None:
        cfg, r = self.cfg, self.cfg.rl
        started = time.perf_counter()
        per_mini = cfg.global_batch_size // r.group_size  # prompts of one optimizer step
        groups, figures = self._sample_groups(phase, r.mini_batches * per_mini)
        rollout_seconds = time.perf_counter() - started
        rewards = torch.tensor([[x.reward for x in g] for g in groups], dtype=torch.float32)
        advantages = compute_advantages(rewards, r.advantage_estimator, r.scale_rewards)
        figures.update(
            advantage_mean=float(advantages.mean()),
            advantage_std=float(advantages.std(unbiased=False)),
            advantage_abs_max=float(advantages.abs().max()),
        )
        figures["rollout_tokens_per_second"] = figures["rollout_tokens"] / max(rollout_seconds, 1e-9)
        figures["rollout_seconds"] = rollout_seconds
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        share = per_mini // dp
        self.mini_batches, diffs, diff_max = [], [], 0.0
        for m in range(r.mini_batches):
            mine = range(m * per_mini + rank * share, m * per_mini + (rank + 1) * share)
            rollouts = [x for i in mine for x in groups[i]]
            values = [float(a) for i in mine for a in advantages[i]]
            batches = rollout_micro_batches(
                self.prompts, rollouts, values, cfg.data.seq_length, cfg.data.batch_size, self.pad_id
            )
            batches = [{k: v.to(self.device) for k, v in mb.items()} for mb in batches]
            recomputed = [] if self.old_from_training else self._old_logps(batches)
            for mb, logps in zip(batches, recomputed):
                mb["old_logps"] = logps
                mask = mb["labels"] != IGNORE_INDEX
                gap = (logps - mb["rollout_logps"]).abs()[mask]
                diffs.append(gap.double())
                diff_max = max(diff_max, float(gap.max()) if gap.numel() else 0.0)
            if self.kind != "none":
                chunks, context = self._reference_chunks()
                for mb, logps in zip(
                    batches, self._token_logps(batches, chunks, context, self.spec.forward_step) or []
                ):
                    mb["ref_logps"] = logps
            self.mini_batches.append(batches)
        if not self.old_from_training:  # else the training forward gives them (:meth:`figures`)
            gaps = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
            figures["logprob_mismatch_mean"] = _mean_over_ranks(gaps.sum(), gaps.numel(), self.device)
            figures["logprob_mismatch_max"] = _max_over_ranks(diff_max, self.device)
        self.phase, self.phase_figures = phase, figures

    def _old_logps(self, batches: list[dict]) -> list[torch.Tensor]:
        """The old policy's per-token log-probabilities of ``batches`` by a forward-only pass of the policy
        (none on a pipeline stage without the loss)."""
        return self._token_logps(batches, self.policy, contextlib.nullcontext(), self.policy_step) or []

    def _reference_chunks(self) -> tuple[list[torch.nn.Module], Any]:
        if self.reference is not None:
            return self.reference, contextlib.nullcontext()
        return self.policy, adapters_disabled(self.policy)

    # -- the step --------------------------------------------------------------------------------------
    def prepare(self, micro_batches: list[dict], data) -> None:
        """Replace the step's placeholders by its rollout micro-batches (a phase's first step samples them)."""
        step = int(micro_batches[0]["rl_step"])
        phase, within = divmod(step, update_phase_steps(self.cfg))
        if within == 0:
            self._rollout_phase(phase)
        elif self.phase != phase:
            raise RuntimeError(
                f"step {step + 1} is inside rollout phase {phase}, whose rollouts this run neither sampled nor "
                "loaded (a resume inside a phase from a checkpoint that holds no rollouts for this rank)"
            )
        micro_batches[:] = self.mini_batches[within % self.cfg.rl.mini_batches]
        self.next_step = step + 1
        self.train_started = time.perf_counter()

    # -- checkpoints ------------------------------------------------------------------------------------
    def _cut(self) -> dict[str, Any]:
        """What a phase's micro-batches depend on: the layout and the micro-batch size."""
        return {**layout_of(self.cfg), "micro_batch_size": self.cfg.data.batch_size}

    def checkpoint_state(self) -> Optional[dict[str, Any]]:
        """The current phase's rollouts when the next step falls inside it (None on a phase boundary, where
        the next step samples afresh): this rank's micro-batches of every mini-batch (CPU copies), the
        phase's figures and the layout they were cut for."""
        if self.phase is None or self.next_step % update_phase_steps(self.cfg) == 0:
            return None
        return {
            "phase": self.phase,
            "cut": self._cut(),
            "mini_batches": [[_moved(mb, "cpu") for mb in batches] for batches in self.mini_batches],
            "figures": dict(self.phase_figures),
        }

    def restore_state(self, state: Optional[dict[str, Any]]) -> None:
        """Take back the rollouts :meth:`checkpoint_state` saved (nothing when the checkpoint holds none)."""
        if state is None:
            return
        if state["cut"] != self._cut():
            saved, now = state["cut"], self._cut()
            raise ValueError(
                f"the checkpoint falls inside rollout phase {state['phase']}, whose saved rollouts were cut for "
                f"{describe_layout(saved)} with data.batch_size {saved['micro_batch_size']}; this run has "
                f"{describe_layout(now)} with data.batch_size {now['micro_batch_size']}: resume it as it was "
                "saved, or from a checkpoint on a phase boundary (a multiple of rl.ppo_epochs x rl.mini_batches)"
            )
        self.phase, self.phase_figures = state["phase"], dict(state["figures"])
        self.mini_batches = [[_moved(mb, self.device) for mb in batches] for batches in state["mini_batches"]]

    def count(self, micro_batches: list[dict]) -> torch.Tensor:
        """The normaliser of ``rl.loss_aggregation`` over the global batch."""
        return count_policy_normalizer(micro_batches, self.loss.loss_aggregation, ps.get_data_parallel_group())

    def figures(self, figures: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The policy loss's figures, the phase's rollout figures and the training pass's tokens/s."""
        seconds = max(time.perf_counter() - self.train_started, 1e-9)
        rows = self.cfg.global_batch_size * self.cfg.data.seq_length
        policy = policy_figures(figures, self.loss, self.largest_gaps)
        if self.old_from_training:  # the phase is this step: its mismatch is the training forward's
            policy["logprob_mismatch_mean"] = policy["logp_diff_mean"]
            policy["logprob_mismatch_max"] = policy["logp_diff_max"]
        return {**policy, **self.phase_figures, "training_tokens_per_second": rows / seconds}

    def evaluate(self, batches, forward_backward, data) -> Optional[dict[str, float]]:
        return None  # no held-out split: the rewards are the figures


def _check_routers(policy: list[torch.nn.Module], model_type: str, device) -> None:
    """Router replay needs a MoE policy: some rank (pipeline stage) must hold a router."""
    count = torch.tensor([float(sum(len(routers(chunk)) for chunk in policy))], device=device)
    if dist.is_initialized():
        dist.all_reduce(count)
    if count.item() == 0:
        raise ValueError(f"rl.router_replay needs a mixture-of-experts policy: model.type {model_type!r} has no router")


def _moved(micro_batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """A copy of a micro-batch's tensors on ``device``."""
    return {k: v.detach().to(device, copy=True) for k, v in micro_batch.items()}


def _mean_over_ranks(total: torch.Tensor, count: int, device) -> float:
    """``total / count`` summed over every rank (the stages without a loss bring 0 of 0; tensor-parallel
    copies scale both alike)."""
    both = torch.tensor([float(total), float(count)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(both)
    return float(both[0] / both[1].clamp(min=1))


def _max_over_ranks(value: float, device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor[0])
