"""``train_mode: dpo``: the reference policy and what a preference step adds to the trainer's.

The policy trains through the family's ``forward_step`` wrapped by
:func:`megacann.models.preference_loss.preference_forward_step` (per-pair losses, rewards as stats), on
the schedules, optimizers and layouts of pretraining. Before a step's forward-backward,
:meth:`PreferenceTraining.prepare` puts the reference policy's sequence log-probabilities into each
micro-batch (``ref_logps``). ``dpo.reference`` says where they come from:

- ``copy``: a frozen copy of the starting weights (``model.init_from``, or the seed), built by the same
  spec on the same layout as the policy, hence sharded like it; a forward-only pass of the step's
  schedule per step (TP, SP, PP, CP and EP as the policy).
- ``adapters_off`` (LoRA): the policy itself with its adapters disabled: the frozen base, no second copy.
- ``precomputed``: one forward-only pass over every sequence of the data before training (with the
  reference above: adapters off with LoRA, else a temporary copy), stored beside the data as
  ``dpo-ref-<key>.npy`` (keyed by the tokenized data, the starting weights and the model); later runs and
  resumed ones read it. Micro-batches then look their values up by ``sequence_index``.
- ``auto``: ``adapters_off`` with LoRA, else ``copy``. SimPO needs no reference and builds none.

The reference runs in eval mode (no dropout) and under ``no_grad``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.config import ConfigError, MegacannConfig
from megacann.layers.lora import adapters_disabled
from megacann.models import ModelSpec
from megacann.models.preference_loss import (
    PreferenceLoss,
    count_pairs,
    preference_figures,
    preference_forward_step,
    reference_forward_step,
)
from megacann.pipeline import get_forward_backward_func, loss_stage
from megacann.training import finetune
from megacann.training.objective import Objective
from megacann.training.rank_model import build_rank_chunks


def reference_kind(cfg: MegacannConfig) -> str:
    """What the reference policy is: ``none`` (SimPO), ``copy``, ``adapters_off`` or ``precomputed``."""
    if not PreferenceLoss.from_config(cfg.dpo).needs_reference:
        return "none"
    kind = cfg.dpo.reference
    if kind == "auto":
        return "adapters_off" if cfg.lora else "copy"
    if kind == "adapters_off" and not cfg.lora:
        raise ConfigError("dpo.reference adapters_off needs lora: true (the base under the adapters)")
    return kind


def build_reference_copy(cfg: MegacannConfig, spec: ModelSpec, device) -> list[torch.nn.Module]:
    """A frozen copy of the starting weights, built and sharded like the policy (without adapters)."""
    plain = dataclasses.replace(cfg, lora=False)
    chunks = build_rank_chunks(plain, spec, device)
    finetune.prepare_model_chunks(plain, chunks)
    for chunk in chunks:
        chunk.requires_grad_(False)
        chunk.eval()
    return chunks


@contextlib.contextmanager
def _eval_mode(chunks: list[torch.nn.Module]):
    modes = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        yield
    finally:
        for chunk, mode in zip(chunks, modes):
            chunk.train(mode)


def forward_only_pass(
    schedule, chunks: list[torch.nn.Module], micro_batches: list[dict], forward_step, context
) -> None:
    """One forward-only pass of ``schedule`` over ``micro_batches`` through ``chunks`` in eval mode, inside
    ``context`` (e.g. adapters disabled): a reference or old policy's values, collected by ``forward_step``."""
    with context, _eval_mode(chunks):
        schedule(chunks, micro_batches, loss_normalizer=1.0, forward_only=True, forward_step=forward_step)


def _computes_loss(cfg: MegacannConfig) -> bool:
    """Whether this rank's pipeline stage computes the loss, hence a reference pass's log-probabilities."""
    stages = ps.get_pipeline_model_parallel_world_size()
    return ps.get_pipeline_model_parallel_rank() == loss_stage(cfg.distributed.pipeline_schedule, stages)


class PreferenceTraining(Objective):
    """The objective of ``train_mode: dpo``: the wrapped forward step, the reference policy, the pair count that normalises the loss, the rewards'
    figures and held-out evaluation."""

    def __init__(self, cfg: MegacannConfig, spec: ModelSpec, policy: list[torch.nn.Module], device):
        self.cfg, self.spec, self.policy, self.device = cfg, spec, policy, device
        self.loss = PreferenceLoss.from_config(cfg.dpo)
        self.kind = reference_kind(cfg)
        self.forward_step = preference_forward_step(spec.forward_step, self.loss)
        self.schedule = get_forward_backward_func(cfg, spec.forward_step)
        self.reference = build_reference_copy(cfg, spec, device) if self.kind == "copy" else None
        self.table: Optional[torch.Tensor] = None  # precomputed: log-prob of every sequence of the data
        self.table_note = ""

    def describe(self) -> str:
        o = self.loss
        what = {
            "none": "none (reference-free)",
            "copy": "a frozen copy of the starting weights, sharded like the policy",
            "adapters_off": "the frozen base (the policy with its LoRA adapters disabled)",
            "precomputed": "log-probabilities of the starting weights precomputed over the data",
        }[self.kind]
        extra = f", label_smoothing {o.label_smoothing}" if o.label_smoothing else ""
        extra += f", gamma {o.simpo_gamma}" if o.loss_type == "simpo" else ""
        extra += f", plus {o.sft_loss_weight} x the chosen answers' NLL" if o.sft_loss_weight else ""
        return f"preference optimisation: {o.loss_type} loss, beta {o.beta}{extra}; reference: {what}{self.table_note}"

    # -- the reference ---------------------------------------------------------------------------------
    def _reference_chunks(self) -> tuple[list[torch.nn.Module], Any]:
        if self.reference is not None:
            return self.reference, contextlib.nullcontext()
        return self.policy, adapters_disabled(self.policy)

    @torch.no_grad()
    def reference_logps(self, micro_batches: list[dict], chunks=None, context=None) -> list[torch.Tensor]:
        """Sequence log-probabilities ``[b]`` of each micro-batch under the reference (one forward-only pass
        of the step's schedule; zeros off the pipeline stage that computes the loss)."""
        if chunks is None:
            chunks, context = self._reference_chunks()
        sink: list[torch.Tensor] = []
        forward_only_pass(
            self.schedule, chunks, micro_batches, reference_forward_step(self.spec.forward_step, sink), context
        )
        if not sink:  # not the stage that computes the loss
            sink = [torch.zeros(mb["labels"].shape[0], device=mb["labels"].device) for mb in micro_batches]
        if len(sink) != len(micro_batches):
            raise RuntimeError(f"reference pass: {len(sink)} results for {len(micro_batches)} micro-batches")
        return sink

    def prepare(self, micro_batches: list[dict], data) -> None:
        """Give each micro-batch its reference log-probabilities (``ref_logps``)."""
        if self.kind == "none":
            return
        if self.kind == "precomputed":
            if self.table is None:
                self.table = self._precomputed(data)
            for mb in micro_batches:
                if "sequence_index" not in mb:
                    raise ValueError("dpo.reference precomputed needs micro-batches with sequence_index")
                mb["ref_logps"] = self.table[mb["sequence_index"].to(self.table.device)].to(mb["labels"].device)
            return
        for mb, logps in zip(micro_batches, self.reference_logps(micro_batches)):
            mb["ref_logps"] = logps

    # -- precomputed reference log-probabilities -------------------------------------------------------
    def _table_path(self, catalog) -> str:
        from megacann.data.cache import digest

        model = dataclasses.asdict(self.cfg.model)
        model.pop("init_from", None)
        key = digest(
            1,
            [os.path.basename(d) for d in catalog.cache_dirs],
            finetune.base_reference(self.cfg),
            sorted(model.items()),
        )
        return os.path.join(os.path.dirname(catalog.cache_dirs[0]), f"dpo-ref-{key}.npy")

    def _precomputed(self, data) -> torch.Tensor:
        catalog = getattr(data, "preference_catalog", None)
        if catalog is None:
            raise ValueError("dpo.reference precomputed needs the recipe's preference data (data.path)")
        path = self._table_path(catalog)
        have = torch.tensor([1.0 if os.path.exists(path) else 0.0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if have.item() == 1.0:
            table = torch.from_numpy(np.load(path))
            if len(table) != len(catalog.samples):
                raise ValueError(f"{path}: holds {len(table)} values for {len(catalog.samples)} sequences; delete it")
            self.table_note = f" (from {path})"
            return table.to(self.device)
        table = self._compute_table(catalog)
        if not dist.is_initialized() or dist.get_rank() == 0:
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                np.save(f, table.cpu().numpy())
            os.replace(tmp, path)
        self.table_note = f" (computed over {len(table)} sequences, saved as {path})"
        return table

    def _compute_table(self, catalog) -> torch.Tensor:
        """One forward-only pass over every sequence: micro-batches of ``data.batch_size`` sequences dealt
        round-robin to data-parallel ranks, run ``grad_accum_steps`` at a time; summed over the world."""
        from megacann.data.loader import collate

        if self.cfg.lora:
            chunks, context = self.policy, adapters_disabled(self.policy)
        else:
            chunks, context = build_reference_copy(self.cfg, self.spec, self.device), contextlib.nullcontext()
        n, b = len(catalog.samples), self.cfg.data.batch_size
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        group = self.cfg.optim.grad_accum_steps
        per_rank = math.ceil(math.ceil(n / b) / dp)
        per_rank = math.ceil(per_rank / group) * group  # every rank runs the same number of micro-batches
        table = torch.zeros(n, dtype=torch.float32, device=self.device)
        writes = (
            _computes_loss(self.cfg)
            and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
        )
        for first in range(0, per_rank, group):
            rows = [[(k * dp + rank) * b + j for j in range(b)] for k in range(first, first + group)]
            # rows past the data's end read its last sequence (full micro-batches) and are not written: the
            # ranks' tables are summed, so each sequence is written by one rank
            batches = [collate([catalog.sequence(min(i, n - 1)) for i in idx]) for idx in rows]
            batches = [{k: v.to(self.device) for k, v in mb.items()} for mb in batches]
            for idx, logps in zip(rows, self.reference_logps(batches, chunks, context)):
                index = torch.tensor(idx, device=self.device)
                if writes:
                    table[index[index < n]] = logps[index < n]
        if dist.is_initialized():
            dist.all_reduce(table)
        return table

    # -- the step --------------------------------------------------------------------------------------
    def count(self, micro_batches: list[dict]) -> torch.Tensor:
        """Pairs in the global batch: what the step's loss is a mean over."""
        return count_pairs(micro_batches, ps.get_data_parallel_group())

    def figures(self, figures: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return preference_figures(figures)

    @torch.no_grad()
    def evaluate(self, batches: Iterator[dict], forward_backward, data) -> Optional[dict[str, float]]:
        """Mean pair loss, reward accuracy and margin over ``logging.eval_iters`` held-out global batches
        (``batches``: this rank's held-out micro-batches, on the device)."""
        sums = {"eval_loss": 0.0, "eval_reward_accuracy": 0.0, "eval_reward_margin": 0.0}
        pairs = 0.0
        for _ in range(self.cfg.logging.eval_iters):
            micro_batches = list(itertools.islice(batches, self.cfg.optim.grad_accum_steps))
            if len(micro_batches) < self.cfg.optim.grad_accum_steps:
                break
            self.prepare(micro_batches, data)
            count = self.count(micro_batches)
            totals = forward_backward(self.policy, micro_batches, loss_normalizer=1.0, forward_only=True)
            figures = preference_figures(totals.reduce(count))
            n = count.item()
            pairs += n
            sums["eval_loss"] += float(figures["loss"]) * n
            sums["eval_reward_accuracy"] += float(figures["reward_accuracy"]) * n
            sums["eval_reward_margin"] += float(figures["reward_margin"]) * n
        if pairs == 0:
            return None
        return {k: v / pairs for k, v in sums.items()}
