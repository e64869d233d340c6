"""The loss a model's head computes: per-token cross entropy over vocabulary-parallel logits.

- Targets equal to :data:`~megacann.constants.IGNORE_INDEX` take no loss (prompt tokens in SFT, padding,
  masked EOD).
- :func:`token_loss` is the per-token fp32 cross entropy a model's last chunk returns to the trainer (in
  the model contract's ``ChunkOutput``); how a step normalises, weights and logs it is the contract's
  business (:mod:`megacann.models.contract`), not the layers'.

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

from typing import Optional

import torch
import torch.distributed as dist

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


@torch.no_grad()
def vocab_parallel_entropy(
    logits_shard: torch.Tensor, vocab_size: Optional[int] = None, group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` (fp32, ``[...]``) of the softmax over vocabulary-parallel logits
    ``[..., V_padded/tp]``, for logging (no gradient). As the cross entropy, it never gathers the logits:
    with ``m`` the global max, ``S = sum exp(z - m)`` and ``T = sum exp(z - m) (z - m)`` summed over the
    TP group, the entropy is ``log S - T / S``; padded columns (ids ``>= vocab_size``) are excluded."""
    group = mappings.tp_group(group)
    world = dist.get_world_size(group) if group is not None else 1
    local_vocab = logits_shard.shape[-1]
    start = (dist.get_rank(group) if group is not None else 0) * local_vocab
    valid = local_vocab if vocab_size is None else max(0, min(local_vocab, vocab_size - start))
    logits = logits_shard[..., :valid].float()
    if valid > 0:
        row_max = logits.amax(dim=-1)
    else:  # this rank holds only padding columns
        row_max = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
    if world > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max.unsqueeze(-1)
    weights = shifted.exp()
    sums = torch.stack([weights.sum(dim=-1), (weights * shifted).sum(dim=-1)])
    if world > 1:
        dist.all_reduce(sums, group=group)
    return sums[0].log() - sums[1] / sums[0]
