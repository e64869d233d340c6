"""The training loss, in one place: ignored targets, the per-token loss, its normalisation, auxiliary losses.

- Targets equal to :data:`~megacann.constants.IGNORE_INDEX` take no loss (prompt tokens in SFT, padding, masked EOD).
- :func:`token_loss` is the per-token fp32 cross entropy over vocabulary-parallel logits.
- A step's loss is the sum of every target token's loss in the *global* batch divided by the number of
  target tokens in it (:func:`count_target_tokens`); each micro-batch's sum is divided by that count before
  backward, and gradients are summed (not averaged) over data-parallel ranks, so any data / tensor /
  pipeline layout and any split into micro-batches gives the gradient of one big batch. Under context
  parallelism each cp rank holds a share of every sequence's tokens, so the sums run over the
  data-parallel x context-parallel group.
- Auxiliary losses (an MoE router's balancing loss, say) are scalars a model chunk returns beside its
  output, on any pipeline stage, already multiplied by their coefficients. Each micro-batch's value is
  weighted by 1 / (micro-batches x data-parallel x context-parallel ranks), so the step optimises their
  mean, and they are logged as that mean, summed over layers and pipeline stages (:class:`LossTotals`).
- ``stats`` are numbers a chunk reports for logging only (per-expert token counts, say): summed.

The cross entropy runs over vocabulary-parallel logits, in fp32, without ever gathering the full logits.
Each TP rank holds the logits of its vocabulary range ``[..., V/tp]``. The softmax needs only three numbers
per token from the other ranks (the max, the sum of exponentials, the target's logit, plus the sum of
logits for label smoothing), exchanged in two small all-reduces. The backward is the textbook
``softmax - target distribution``, computed on each rank's slice. Padded vocabulary columns (ids
``>= vocab_size``) are excluded, as if their logits were -inf, and label smoothing spreads over the
``vocab_size`` real tokens only: different TP sizes pad the vocabulary differently and must give the same
loss.
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
from megacann.layers import mappings


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, vocab_size, group, inplace):
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        local_vocab = logits.shape[-1]
        start = rank * local_vocab
        valid = local_vocab if vocab_size is None else max(0, min(local_vocab, vocab_size - start))
        classes = local_vocab * world if vocab_size is None else vocab_size

        if valid > 0:
            row_max = logits[..., :valid].amax(dim=-1).float()
        else:  # this rank holds only padding columns
            row_max = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        if world > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        # the one fp32 working buffer of the logits' size: shifted logits, then their exponentials
        if inplace and logits.dtype == torch.float32:
            work = logits.sub_(row_max.unsqueeze(-1))
        else:
            work = torch.sub(logits, row_max.unsqueeze(-1))
        if valid < local_vocab:
            work[..., valid:] = float("-inf")

        ignored = target == ignore_index
        local_target = target - start
        in_shard = (local_target >= 0) & (local_target < valid) & ~ignored
        local_target = local_target.masked_fill(~in_shard, 0)
        target_logit = work.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill_(~in_shard, 0.0)
        stats = [target_logit]
        if label_smoothing > 0.0:
            stats.append(work[..., :valid].sum(dim=-1))
        work.exp_()
        stats.append(work.sum(dim=-1))
        stats = torch.stack(stats)
        if world > 1:
            dist.all_reduce(stats, group=group)
        sum_exp = stats[-1]
        log_z = sum_exp.log()
        loss = log_z - stats[0]
        if label_smoothing > 0.0:
            smooth = log_z - stats[1] / classes  # mean over the real classes of -log p
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        loss.masked_fill_(ignored, 0.0)

        ctx.save_for_backward(work, sum_exp, local_target, in_shard, ignored)
        ctx.label_smoothing, ctx.classes, ctx.valid = label_smoothing, classes, valid
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        exp, sum_exp, local_target, in_shard, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        scale = grad_loss.float().masked_fill(ignored, 0.0)
        # softmax * g, written over the saved exponentials: this graph can be walked backward once
        grad = exp.mul_((scale / sum_exp).unsqueeze(-1))
        hit = (scale * in_shard).mul_(-(1.0 - eps)).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), hit)
        if eps > 0.0:
            grad[..., : ctx.valid] -= (scale * (eps / ctx.classes)).unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    vocab_size: Optional[int] = None,
    group: Optional[dist.ProcessGroup] = None,
    inplace: bool = False,
) -> torch.Tensor:
    """Per-token cross entropy (fp32, shape of ``target``, 0 where ``target == ignore_index``).

    Args:
        logits_shard: ``[..., V_padded/tp]``, this TP rank's vocabulary range (any float dtype).
        target: ``[...]`` token ids in ``[0, vocab_size)`` or ``ignore_index``.
        label_smoothing: as in ``torch.nn.functional.cross_entropy``, over the real vocabulary.
        vocab_size: the logical vocabulary; logit columns at or past it (padding) are excluded.
            None: every column is a real class.
        inplace: fp32 logits only: use ``logits_shard``'s memory as the working buffer instead of a new
            one (faster, less memory); its values are destroyed, so nothing may read it afterwards.
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    group = mappings.tp_group(group)
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    if vocab_size is not None:
        world = dist.get_world_size(group) if group is not None else 1
        if vocab_size > logits_shard.shape[-1] * world:
            raise ValueError(
                f"vocab_size {vocab_size} exceeds the {logits_shard.shape[-1] * world} logit columns "
                f"({logits_shard.shape[-1]} per rank x {world} TP ranks)"
            )
    return _VocabParallelCrossEntropy.apply(
        logits_shard, target, ignore_index, label_smoothing, vocab_size, group, inplace
    )


def token_loss(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: Optional[int] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Per-token fp32 cross entropy ``[b, s]`` of vocabulary-parallel logits; 0 where ``labels`` is ignored."""
    return vocab_parallel_cross_entropy(
        logits_shard, labels, ignore_index=IGNORE_INDEX, vocab_size=vocab_size, group=group
    )


@dataclass
class ChunkOutput:
    """What one model chunk gives back for one micro-batch (see :class:`megacann.models.ModelSpec`).

    ``hidden_states`` out of a chunk without the head (sent to the next pipeline stage); ``token_loss``
    (``[b, s]`` fp32, 0 at ignored targets) out of the model's last chunk; ``aux_losses`` from any chunk.
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
    """Detached sums over a step's micro-batches on this rank: token loss, auxiliary losses, stats."""

    def __init__(self, device: torch.device):
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

    def reduce(self, num_tokens: Union[float, torch.Tensor], aux_weight: float) -> dict[str, torch.Tensor]:
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
            out[short] = value * aux_weight if kind == "aux" else value
        return out
