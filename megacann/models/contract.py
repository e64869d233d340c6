"""The model contract's runtime half: what a model chunk gives back for a micro-batch (:class:`ChunkOutput`)
and how a training step turns those into its objective and logged figures, the same way for every family
and layout. The pipeline schedules and the trainer know a model's outputs only through this module (the
declarative half, :class:`~megacann.models.spec.ModelSpec` and its registry, is :mod:`megacann.models.spec`).

- A step's loss is the sum of every target token's loss in the *global* batch divided by the number of
  target tokens in it (:func:`count_target_tokens`); each micro-batch's sum is divided by that count before
  backward, and gradients are summed (not averaged) over data-parallel ranks, so any data / tensor /
  pipeline layout and any split into micro-batches gives the gradient of one big batch. Under context
  parallelism each cp rank holds a share of every sequence's tokens, so the sums run over the
  data-parallel x context-parallel group.
- Auxiliary losses (an MoE router's balancing loss, say) are scalars a model chunk returns beside its
  output, on any pipeline stage, already multiplied by their coefficients. Each micro-batch's value is
  weighted by 1 / (micro-batches x data-parallel x context-parallel ranks) (:func:`aux_loss_weight`), so the
  step optimises their mean, and they are logged as that mean, summed over layers and pipeline stages
  (:class:`LossTotals`, which carries the one weight the schedule chose for the step).
- ``stats`` are numbers a chunk reports for logging only (per-expert token counts, say): summed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.collectives import all_reduce_if_parallel
from megacann.constants import IGNORE_INDEX


@dataclass
class ChunkOutput:
    """What one model chunk gives back for one micro-batch (a :class:`~megacann.models.spec.ModelSpec`'s
    ``forward_step``).

    ``hidden_states`` out of a chunk without the head (sent to the next pipeline stage); ``token_loss``
    (``[b, s]`` fp32, 0 at ignored targets) out of the model's last chunk; ``aux_losses`` from any chunk;
    ``stats`` (logged only) from any chunk.
    """

    hidden_states: Optional[torch.Tensor] = None
    token_loss: Optional[torch.Tensor] = None
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


def count_target_tokens(micro_batches: Iterable[dict[str, torch.Tensor]], group=None) -> torch.Tensor:
    """Target tokens (labels not ignored) in these micro-batches, summed over ``group`` (the data-parallel
    group: the whole global batch). A 1-element fp32 tensor, on the labels' device."""
    count = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches).to(torch.float32).reshape(1)
    return all_reduce_if_parallel(count, group)


def aux_loss_weight(num_micro_batches: int, data_parallel_size: int) -> float:
    """The factor of each micro-batch's auxiliary loss, so that summed gradients optimise their mean
    (``data_parallel_size``: the ranks gradients are summed over, dp x cp)."""
    return 1.0 / (num_micro_batches * data_parallel_size)


def backward_objective(
    output: ChunkOutput,
    *,
    normalizer: Union[float, torch.Tensor],
    aux_weight: float,
    loss_scale: float = 1.0,
) -> Optional[torch.Tensor]:
    """The scalar a chunk's backward starts from, besides the gradient its hidden states receive:
    ``(sum(token_loss) / normalizer + aux_weight * sum(aux_losses)) * loss_scale``; None when neither.
    ``normalizer`` may be a device tensor (the token count), so the step need not read it on the host."""
    objective = None
    if output.token_loss is not None:
        objective = output.token_loss.sum() * (loss_scale / normalizer)
    if output.aux_losses:
        aux = torch.stack([v.float().reshape(()) for v in output.aux_losses.values()]).sum() * (aux_weight * loss_scale)
        objective = aux if objective is None else objective + aux
    return objective


class LossTotals:
    """Detached sums over a step's micro-batches on this rank: token loss, auxiliary losses, stats.

    ``aux_weight`` is the step's weight of each micro-batch's auxiliary losses (:func:`aux_loss_weight`):
    the schedule computes it once, weights the backward objective with it and the logged figures reuse it.
    """

    def __init__(self, device: torch.device, aux_weight: float):
        self.aux_weight = aux_weight
        self.token_loss = torch.zeros((), dtype=torch.float32, device=device)
        self.aux: dict[str, torch.Tensor] = {}
        self.stats: dict[str, torch.Tensor] = {}

    def add(self, output: ChunkOutput) -> None:
        if output.token_loss is not None:
            self.token_loss = self.token_loss + output.token_loss.detach().float().sum()
        for target, values in ((self.aux, output.aux_losses), (self.stats, output.stats)):
            for name, value in values.items():
                value = value.detach().float()
                target[name] = target[name] + value if name in target else value

    def reduce(self, num_tokens: Union[float, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's figures, the same on every rank: ``loss`` (mean per target token of the global batch),
        each auxiliary loss as its mean over micro-batches and data-parallel ranks (summed over layers
        and stages), each stat summed over everything. Sums run over the data-parallel x context-parallel
        group: each cp rank holds the losses of its share of the tokens. Tensors (the loss 0-d, the others
        1-d) left on the device, so reading them is the caller's choice (:func:`megacann.training.to_host`
        reads them all at once); with pipeline parallelism the stages' names are merged on the host (one
        synchronisation)."""
        dp, pp = ps.get_data_parallel_group(with_context_parallel=True), ps.get_pipeline_model_parallel_group()
        names = sorted(self.aux), sorted(self.stats)
        parts = [self.token_loss.reshape(1)]
        parts += [self.aux[n].reshape(-1) for n in names[0]] + [self.stats[n].reshape(-1) for n in names[1]]
        flat = all_reduce_if_parallel(torch.cat(parts), dp)  # every data-parallel rank holds the same names
        merged: dict[str, torch.Tensor] = {"loss": flat[0]}
        offset = 1
        for prefix, group_names, source in (("aux", names[0], self.aux), ("stats", names[1], self.stats)):
            for n in group_names:
                size = source[n].numel()
                merged[f"{prefix}/{n}"] = flat[offset : offset + size]
                offset += size
        if pp is not None and dist.get_world_size(pp) > 1:  # stages hold different layers, hence names
            gathered: list = [None] * dist.get_world_size(pp)
            dist.all_gather_object(gathered, {name: value.cpu() for name, value in merged.items()}, group=pp)
            merged = {}
            for stage in gathered:
                for name, value in stage.items():
                    merged[name] = merged[name] + value if name in merged else value
        loss = merged.pop("loss")
        count = torch.as_tensor(num_tokens, dtype=torch.float32, device=loss.device).reshape(())
        out: dict[str, torch.Tensor] = {"loss": loss / count.clamp(min=1.0)}
        for name, value in sorted(merged.items()):
            kind, short = name.split("/", 1)
            out[short] = value * self.aux_weight if kind == "aux" else value
        return out
