"""The output head and its cross entropy fused: per-token loss of ``hidden @ weight.T`` without ever holding
the logits of the whole micro-batch.

Tokens are processed in chunks of ``chunk_size``. Forward: for each chunk, the chunk's logits over this
rank's vocabulary shard give a local log-sum-exp and the target's logit; after the last chunk two small
all-reduces over the tensor-parallel group combine the shards (max of the local log-sum-exps, then the sum
of ``exp(lse_r - max)`` together with the target logits). Only the per-token log-sum-exp (fp32) is kept.
Backward: each chunk's logits are recomputed (one more matmul of the chunk), overwritten in place by
``(softmax - onehot) * grad`` and multiplied back into the gradients of ``hidden`` and ``weight``.

In a split backward's B (zero-bubble schedules, :mod:`megacann.ops.weight_grad`) only ``hidden``'s gradient
is computed; W recomputes each chunk's logits and their gradient once more for the weight's (one more
logits product per chunk, never the whole micro-batch's logit gradients held), bit for bit the fused result.

Peak memory is one chunk's logits (besides the gradients themselves) instead of the whole micro-batch's
logits in the model dtype, their fp32 working copy and their gradient. The result equals ``F.linear`` followed by
:func:`megacann.layers.vocab_parallel_cross_entropy` (same ignore_index and vocabulary-padding rules), and
so do the gradients: ``hidden``'s gradient is this rank's partial sum, as ``F.linear``'s would be; the
caller reduces it over the tensor-parallel group (``copy_to_tensor_model_parallel_region``) exactly as
``ColumnParallelLinear`` does.

On CPUs without native bf16 GEMM, bf16 products run as fp32 GEMMs (:mod:`megacann.ops.bf16_matmul`): the
logits are then fp32 (not rounded to bf16) and the weight's fp32 copy lives while the op runs.

The per-chunk arithmetic comes from a :class:`ShardKernels` pair: plain PyTorch here (any device), the C++
kernels of ``csrc/`` on CPU (:mod:`megacann.ops.cpp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.constants import IGNORE_INDEX
from megacann.ops.bf16_matmul import gemm_dtype
from megacann.ops.registry import REFERENCE, register
from megacann.ops.signatures import DEFAULT_CHUNK_SIZE
from megacann.ops.weight_grad import active_store, defer_or_compute, kept_until_w


@dataclass(frozen=True)
class ShardKernels:
    """``stats(logits, target, start, valid, ignore_index) -> (lse, target_logit)`` over the first ``valid``
    columns of a vocabulary shard that starts at token id ``start`` (fp32, target logit 0 when the target is
    elsewhere or ignored); ``grad_(logits, target, lse, grad_loss, start, valid, ignore_index)`` overwrites
    the (contiguous) logits with ``(softmax - onehot) * grad_loss`` (0 in padding columns and ignored rows)."""

    stats: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    grad_: Callable[..., None]


def _target_in_shard(target: torch.Tensor, start: int, valid: int, ignore_index: int):
    local = target - start
    hit = (local >= 0) & (local < valid) & (target != ignore_index)
    return local.masked_fill(~hit, 0), hit


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the loss is computed and accumulated in: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def torch_stats(logits, target, start: int, valid: int, ignore_index: int):
    acc = acc_dtype(logits.dtype)
    if valid == 0:
        lse = torch.full(target.shape, float("-inf"), dtype=acc, device=logits.device)
        return lse, torch.zeros(target.shape, dtype=acc, device=logits.device)
    x = logits[:, :valid].to(acc)
    row_max = x.amax(dim=-1)
    lse = row_max + (x - row_max.unsqueeze(-1)).exp_().sum(dim=-1).log_()
    local, hit = _target_in_shard(target, start, valid, ignore_index)
    target_logit = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill_(~hit, 0.0)
    return lse, target_logit


def torch_grad_(logits, target, lse, grad_loss, start: int, valid: int, ignore_index: int) -> None:
    acc = acc_dtype(logits.dtype)
    scale = grad_loss.to(acc).masked_fill(target == ignore_index, 0.0)
    if valid > 0:
        x = logits[:, :valid]
        work = x if x.dtype == acc else x.to(acc)  # in place for fp32 logits
        work.sub_(lse.unsqueeze(-1)).exp_().mul_(scale.unsqueeze(-1))
        local, hit = _target_in_shard(target, start, valid, ignore_index)
        work.scatter_add_(-1, local.unsqueeze(-1), (-scale * hit).unsqueeze(-1))
        if work is not x:
            x.copy_(work)
    logits[:, valid:] = 0


TORCH_KERNELS = ShardKernels(torch_stats, torch_grad_)


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


def _chunk_logits(h: torch.Tensor, weight_mm: torch.Tensor, buffer: Optional[torch.Tensor]):
    """``(logits, buffer)``: ``h @ weight_mm.T`` written into the first rows of ``buffer``, which the first
    (largest) chunk of a pass allocates. A pass over the chunks thus allocates one chunk's logits instead of
    one per chunk: on CPU a fresh allocation that size is mapped and zero-filled by the OS page by page, which
    cost about as much as the product itself at the CPU benchmark's shape (131 MB per 1024-token chunk)."""
    if buffer is None:
        buffer = torch.empty((h.shape[0], weight_mm.shape[0]), dtype=h.dtype, device=h.device)
    logits = buffer[: h.shape[0]]
    torch.mm(h, weight_mm.t(), out=logits)
    return logits, buffer


_EARLY_MISSED = [False]  # a backward the early gradients could not serve has run in this process


class _EarlyGrads:
    """The gradients of a one-shard head loss for a unit gradient of every counted token, summed in the
    forward while each chunk's logits exist, so the backward need not recompute them: ``hidden``'s
    (``[T, h]``, fp32) and the weight's (fp32). They serve a backward whose ``grad_loss`` is the same for
    every counted token (a mean over tokens: the usual case), scaled by it; any other ``grad_loss`` takes
    the recomputing path, and after one such backward this process stops summing them early (a preference
    loss weighs its tokens by sequence). Decided on the host, so only for CPU tensors (reading a CPU tensor
    waits for no device)."""

    def __init__(self, hidden, weight, target, ignore_index: int, need_hidden: bool, need_weight: bool):
        acc = acc_dtype(hidden.dtype)
        self.counted = target != ignore_index
        self.unit = torch.ones(target.shape, dtype=acc, device=target.device)
        self.need_hidden, self.need_weight = need_hidden, need_weight
        self.hidden_dtype, self.weight_dtype = hidden.dtype, weight.dtype
        self.grad_hidden = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if self.need_hidden else None
        # written whole by the first chunk (beta 0 ignores what the empty tensor holds), then summed into
        self.grad_weight = torch.empty(weight.shape, dtype=acc, device=weight.device) if self.need_weight else None
        self.weight_written = False

    def add(self, rows: slice, grad_logits: torch.Tensor, h: torch.Tensor, weight_mm: torch.Tensor) -> None:
        """One chunk's share, from its logits' gradient for unit ``grad_loss``."""
        if self.need_hidden:
            self.grad_hidden[rows] = grad_logits.mm(weight_mm)
        if self.need_weight:
            first = not self.weight_written
            if self.grad_weight.dtype == grad_logits.dtype:
                self.grad_weight.addmm_(grad_logits.t(), h, beta=0 if first else 1)
            elif first:
                self.grad_weight.copy_(grad_logits.t().mm(h))
            else:
                self.grad_weight += grad_logits.t().mm(h)
            self.weight_written = True

    def serves(self, grad_loss: torch.Tensor) -> bool:
        """Whether ``grad_loss`` is one value over the counted tokens (host read: CPU only)."""
        counted = grad_loss[self.counted]
        return counted.numel() == 0 or torch.equal(counted, counted[:1].expand_as(counted))

    def grads(self, grad_loss: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The gradients for ``grad_loss`` (which :meth:`serves`), in the inputs' dtypes."""
        counted = grad_loss[self.counted]
        scale = counted[:1].to(self.unit.dtype) if counted.numel() else self.unit.new_zeros(1)
        grad_hidden = grad_weight = None
        if self.need_hidden:
            grad_hidden = self.grad_hidden.mul_(scale).to(self.hidden_dtype)
        if self.need_weight:
            if not self.weight_written:  # no rows: nothing was summed
                self.grad_weight.zero_()
            grad_weight = self.grad_weight.mul_(scale).to(self.weight_dtype)
        return grad_hidden, grad_weight


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, vocab_size, ignore_index, group, chunk_size, kernels, defer, early):
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        local_vocab = weight.shape[0]
        start = rank * local_vocab
        valid = local_vocab if vocab_size is None else max(0, min(local_vocab, vocab_size - start))
        lse = torch.empty(target.shape, dtype=acc_dtype(hidden.dtype), device=hidden.device)
        target_logit = torch.empty_like(lse)
        mm = gemm_dtype(hidden, weight)  # fp32 on CPUs without bf16 GEMM: fp32 logits (the copies transient)
        weight_mm = weight.to(mm)
        needs = ctx.needs_input_grad[:2]
        early = _EarlyGrads(hidden, weight, target, ignore_index, *needs) if early and world == 1 else None
        buffer = None
        for rows in _chunks(target.shape[0], chunk_size):
            h = hidden[rows].to(mm)
            logits, buffer = _chunk_logits(h, weight_mm, buffer)
            lse[rows], target_logit[rows] = kernels.stats(logits, target[rows], start, valid, ignore_index)
            if early is not None:
                kernels.grad_(logits, target[rows], lse[rows], early.unit[rows], start, valid, ignore_index)
                early.add(rows, logits, h, weight_mm)
        logits = buffer = None  # the chunk buffer freed before the shards are combined
        if world > 1:  # combine the shards: lse = max + log(sum_r exp(lse_r - max))
            top = lse.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            stats = torch.stack(((lse - top).exp_(), target_logit))
            dist.all_reduce(stats, group=group)
            lse = top + stats[0].log()
            target_logit = stats[1]
        ignored = target == ignore_index
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.shard = (start, valid, ignore_index, chunk_size, kernels)
        ctx.weight, ctx.defer = weight, defer  # the tensor a deferred weight gradient differentiates into
        ctx.early = early
        return (lse - target_logit).masked_fill_(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, target, lse = ctx.saved_tensors
        shard, weight_input, ctx.weight = ctx.shard, ctx.weight, None
        early, ctx.early = ctx.early, None
        if early is not None:
            if early.serves(grad_loss):
                grad_hidden, grad_weight = early.grads(grad_loss)
                if ctx.defer and grad_weight is not None:  # B of a split: W hands over the sum made in the forward
                    summed = grad_weight
                    (grad_weight,) = defer_or_compute((weight_input,), lambda: (summed,))
                return grad_hidden, grad_weight, None, None, None, None, None, None, None, None
            _EARLY_MISSED[0] = True  # grad_loss varies over tokens here: recompute from now on
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        defer = ctx.defer and need_weight and active_store() is not None  # B of a split: W recomputes the logits
        grad_weight = _chunked_grads(
            hidden, weight, target, lse, grad_loss, shard, grad_hidden, need_weight and not defer
        )
        if defer:
            args = (hidden, weight, target, lse, grad_loss, shard, None, True)
            (grad_weight,) = defer_or_compute((weight_input,), lambda: (_chunked_grads(*args),))
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def _chunked_grads(hidden, weight, target, lse, grad_loss, shard, grad_hidden, need_weight):
    """Chunk by chunk: the logits recomputed and overwritten by their gradient, multiplied into
    ``grad_hidden`` (when given) and into the weight's gradient (returned when ``need_weight``, else None).
    bf16 products run as fp32 GEMMs where the CPU has no bf16 GEMM (``gemm_dtype``)."""
    start, valid, ignore_index, chunk_size, kernels = shard
    grad_weight = None
    if need_weight:  # accumulated over chunks in fp32, cast once
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype(weight.dtype), device=weight.device)
    mm = gemm_dtype(hidden, weight)
    weight_mm = weight.to(mm)
    buffer = None
    for rows in _chunks(target.shape[0], chunk_size):
        h = hidden[rows].to(mm)
        grad_logits, buffer = _chunk_logits(h, weight_mm, buffer)  # the chunk's logits, overwritten by their gradient
        kernels.grad_(grad_logits, target[rows], lse[rows], grad_loss[rows], start, valid, ignore_index)
        if grad_hidden is not None and mm == hidden.dtype:
            torch.mm(grad_logits, weight_mm, out=grad_hidden[rows])
        elif grad_hidden is not None:
            grad_hidden[rows] = torch.mm(grad_logits, weight_mm)  # rounded to hidden's dtype
        if need_weight:
            if grad_weight.dtype == grad_logits.dtype:
                grad_weight.addmm_(grad_logits.t(), h)
            else:
                grad_weight += grad_logits.t().mm(h)
    return grad_weight.to(weight.dtype) if need_weight else None


def head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: Optional[int] = None,
    ignore_index: int = IGNORE_INDEX,
    group: Optional[dist.ProcessGroup] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    kernels: ShardKernels = TORCH_KERNELS,
) -> torch.Tensor:
    """Per-token fp32 loss of ``F.linear(hidden, weight)`` against ``target`` (shape of ``target``, 0 where
    ignored); see the module docstring. ``hidden`` ``[..., h]``, ``weight`` ``[V_padded/tp, h]`` (this
    rank's vocabulary shard), ``target`` ``[...]``; ``group`` None means the tensor-parallel group of
    :mod:`megacann.parallel_state` (none when it is not initialised). In a split backward's B the weight's
    gradient waits for W unless the weight is freed before it (:func:`~megacann.ops.weight_grad.kept_until_w`:
    W reads the weight again)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    if hidden.shape[:-1] != target.shape or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"vocab_parallel_head_loss: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and "
            f"target {tuple(target.shape)} do not fit (hidden [..., h], weight [V, h], target [...])"
        )
    group = group if group is not None else ps.get_tensor_model_parallel_group()
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    world = dist.get_world_size(group) if group is not None else 1
    if vocab_size is not None and vocab_size > weight.shape[0] * world:
        raise ValueError(
            f"vocab_size {vocab_size} exceeds the {weight.shape[0] * world} head rows "
            f"({weight.shape[0]} per rank x {world} TP ranks)"
        )
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_target = target.reshape(-1).long()
    # one shard on CPU under autograd: the gradients are summed in the forward (_EarlyGrads), no logits recomputed
    early = (
        world == 1
        and not _EARLY_MISSED[0]
        and hidden.device.type == "cpu"
        and torch.is_grad_enabled()
        and (hidden.requires_grad or weight.requires_grad)
    )
    defer = kept_until_w(weight)  # a split backward's W reads the weight again: it must still be there
    loss = _HeadLoss.apply(
        flat_hidden, weight, flat_target, vocab_size, ignore_index, group, chunk_size, kernels, defer, early
    )
    return loss.view(target.shape)


register("vocab_parallel_head_loss", REFERENCE)(head_loss)
