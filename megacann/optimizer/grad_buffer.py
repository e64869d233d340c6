"""Contiguous fp32 gradient buffers, split in buckets, reduced over the data-parallel group.

Every trainable parameter gets ``param.main_grad``, a view into one flat fp32 buffer, where its gradient
accumulates over micro-batches whatever the parameter's own dtype. The buffer is not zeroed between steps:
a parameter's first gradient of a step is copied into its slot (a post-accumulate-grad hook; autograd hands
the fresh tensor over as ``.grad``, which :meth:`GradBuffer.zero` left None), later ones are added (fp32
parameters then use the view as their ``.grad``, so autograd adds in place; others add from the hook), and
only the slots that received nothing are zeroed, when their bucket's reduction starts. ``0 + g == g``, so
the sums are bitwise those of zeroing first. Buckets are contiguous ranges of that buffer reduced with one
collective each, in bucket order on every rank. Parameters are laid out in reverse order, so the buckets
whose gradients backward produces first come first.

With ``overlap`` a bucket's reduction starts from the backward hooks as soon as every gradient in it is
final, i.e. during the backward of the last micro-batch: the schedule runs that backward inside
:meth:`GradBuffers.last_micro_batch_backward` (handed to it as ``grad_sync_context``, the way Megatron hands
its schedules ``grad_sync_func``); :meth:`GradBuffers.finish_grad_sync` starts the rest and waits.

ZeRO (``ShardedGradBuffer``) reduce-scatters the same buckets instead, which is why buckets are then
padded to a multiple of the data-parallel size, and may keep a bucket's full storage only until it is
reduced (``persistent=False``). Buffers are per (expert or dense, parameter dtype): dense parameters are
reduced over the data-parallel group, expert-parallel ones over the expert-data-parallel group, both
joined with the context-parallel group (each cp rank's gradients come from its share of the tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megacann import parallel_state as ps
from megacann.layers.sharding import SHARED_EMBEDDING_ATTR, get_sharding


@dataclass
class Bucket:
    """A contiguous range [start, end) of a buffer and the parameters whose gradients lie in it."""

    params: list[torch.nn.Parameter]
    start: int
    end: int
    index: int
    data: Optional[torch.Tensor] = None  # the bucket's gradients (None: not allocated, ZeRO-2)
    pending: set = field(default_factory=set)  # ids of params whose last-micro-batch gradient is missing
    handle: Optional[dist.Work] = None  # its collective in flight
    launched: bool = False  # its reduction has started this step
    reduced: bool = False  # its reduction has finished this step

    @property
    def numel(self) -> int:
        return self.end - self.start


def _round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


def is_shared_embedding(param: torch.nn.Parameter) -> bool:
    return bool(getattr(param, SHARED_EMBEDDING_ATTR, False))


class GradBuffer:
    """Flat fp32 storage for the gradients of ``params``, all-reduced over ``group`` bucket by bucket.

    ``pad_to`` pads every bucket to a multiple of it; ``own_bucket(param)`` puts a parameter in a bucket of
    its own (ZeRO: tied embeddings, so the first and last pipeline stage shard them alike);
    ``persistent=False`` allocates a bucket's storage at its first gradient and frees it once reduced;
    ``unit_of(param)`` (ZeRO-3: the module that gathers it) starts a new bucket wherever it changes, so a
    bucket never spans two units. fp32 parameters of a persistent buffer use their slot as ``.grad``
    (:attr:`aliased`) once it holds this step's first gradient.
    """

    MAX_IN_FLIGHT = 2  # buckets reducing at once inside backward when storage is freed after reduction

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group: Optional[dist.ProcessGroup],
        bucket_size: int = 40_000_000,
        pad_to: int = 1,
        device: Optional[torch.device] = None,
        own_bucket: Optional[Callable[[torch.nn.Parameter], bool]] = None,
        persistent: bool = True,
        unit_of: Optional[Callable[[torch.nn.Parameter], int]] = None,
    ):
        self.group = group
        self.group_size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        self.params = list(params)
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.device = device or (self.params[0].device if self.params else torch.device("cpu"))
        self.persistent = persistent
        self.ranges: dict[int, tuple[int, int]] = {}
        self.buckets: list[Bucket] = []
        offset, members, bucket_start = 0, [], 0

        def close_bucket() -> None:
            nonlocal offset, members, bucket_start
            offset = _round_up(offset, pad_to)
            self.buckets.append(Bucket(members, bucket_start, offset, len(self.buckets)))
            members, bucket_start = [], offset

        for p in reversed(self.params):
            alone = own_bucket is not None and own_bucket(p)
            new_unit = unit_of is not None and members and unit_of(p) != unit_of(members[-1])
            if (alone or new_unit) and members:
                close_bucket()
            self.ranges[id(p)] = (offset, offset + p.numel())
            offset += p.numel()
            members.append(p)
            if alone or offset - bucket_start >= bucket_size:
                close_bucket()
        if members:
            close_bucket()
        self.numel = offset
        self.bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        # fp32 parameters whose .grad is their slot once written (autograd then accumulates in place)
        self.aliased = {id(p) for p in self.params if p.dtype == torch.float32} if persistent else set()
        self.unwritten: set[int] = set()  # params whose slot holds no gradient of this step yet
        self.data = torch.zeros(self.numel, dtype=torch.float32, device=self.device) if persistent else None
        for bucket in self.buckets:
            if persistent:
                self._bind(bucket, self.data[bucket.start : bucket.end])
        self.allocated_numel = self.numel if persistent else 0  # full-size gradient storage held now
        self.peak_allocated_numel = self.allocated_numel  # its high-water mark since the last zero()
        self.overlapped_buckets = 0  # buckets whose reduction started inside backward this step
        self._next_launch = 0
        self.zero()

    # -- storage ------------------------------------------------------------------------------------
    def _bind(self, bucket: Bucket, data: torch.Tensor) -> None:
        bucket.data = data
        for p in bucket.params:
            start, end = self.ranges[id(p)]
            p.main_grad = data[start - bucket.start : end - bucket.start].view(p.shape)

    def storage(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's gradient storage, allocated on first use when not persistent (only its padding
        zeroed: every slot is written by its first gradient or zeroed at the launch)."""
        if bucket.data is None:
            data = torch.empty(bucket.numel, dtype=torch.float32, device=self.device)
            data[self.ranges[id(bucket.params[-1])][1] - bucket.start :].zero_()
            self._bind(bucket, data)
            self.allocated_numel += bucket.numel
            self.peak_allocated_numel = max(self.peak_allocated_numel, self.allocated_numel)
        return bucket.data

    def release(self, bucket: Bucket) -> None:
        """Free a reduced bucket's full storage (only when not persistent)."""
        if self.persistent or bucket.data is None:
            return
        bucket.data = None
        self.allocated_numel -= bucket.numel
        for p in bucket.params:
            del p.main_grad

    def zero(self) -> None:
        """Start a step: forget last step's gradients (every slot unwritten; an fp32 parameter's ``.grad``
        None, so autograd hands its first gradient over) and reductions. Nothing is filled."""
        for bucket in self.buckets:
            if bucket.handle is not None:
                raise RuntimeError(f"bucket {bucket.index} is still being reduced; finish_grad_sync() first")
            self.release(bucket)
            bucket.pending = {id(p) for p in bucket.params}
            bucket.launched = bucket.reduced = False
        self.unwritten = {id(p) for p in self.params}
        for p in self.params:
            if id(p) in self.aliased:
                p.grad = None
        self.peak_allocated_numel = self.allocated_numel
        self.overlapped_buckets = 0
        self._next_launch = 0

    # -- backward hooks -----------------------------------------------------------------------------
    def _bucket_for_new_grad(self, param: torch.nn.Parameter) -> Bucket:
        bucket = self.bucket_of[id(param)]
        if bucket.launched:
            raise RuntimeError(
                f"a gradient of a {tuple(param.shape)} parameter arrived after its bucket {bucket.index} was "
                "reduced this step: call zero_grad() before the next backward, and announce only the last "
                "micro-batch's backward with optimizer.last_micro_batch_backward()"
            )
        return bucket

    def accumulate(self, param: torch.nn.Parameter) -> None:
        """Take the gradient autograd just accumulated in ``param.grad`` into its slot: copy the step's first
        (then alias the slot as ``.grad``, fp32, or drop it), add later ones (an aliased slot already has)."""
        key = id(param)
        if key in self.unwritten:
            self.storage(self._bucket_for_new_grad(param))
            self.unwritten.discard(key)
            param.main_grad.copy_(param.grad)
            param.grad = param.main_grad if key in self.aliased else None
        elif key not in self.aliased:
            self.storage(self._bucket_for_new_grad(param))
            param.main_grad.add_(param.grad)
            param.grad = None

    def _zero_unwritten(self, bucket: Bucket) -> None:
        """Zero the slots of ``bucket`` that received no gradient this step (before it is reduced or read)."""
        for p in bucket.params:
            if id(p) in self.unwritten:
                self.unwritten.discard(id(p))
                p.main_grad.zero_()
                if id(p) in self.aliased:
                    p.grad = p.main_grad

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        """``param``'s gradient is final: start every bucket, in order, whose gradients all are."""
        bucket = self._bucket_for_new_grad(param)
        bucket.pending.discard(id(param))
        while self._next_launch < len(self.buckets) and not self.buckets[self._next_launch].pending:
            self._launch(self.buckets[self._next_launch])
            self.overlapped_buckets += 1
        self._reap()

    # -- reduction ----------------------------------------------------------------------------------
    def _start_reduction(self, bucket: Bucket) -> Optional[dist.Work]:
        """Start the bucket's collective; returns its handle (None when already done)."""
        if self.group_size == 1:
            return None
        return dist.all_reduce(bucket.data, group=self.group, async_op=True)

    def _after_reduction(self, bucket: Bucket) -> None:
        """Called once per step when the bucket's collective has finished."""

    def _launch(self, bucket: Bucket) -> None:
        self.storage(bucket)  # a bucket nobody wrote to still takes part, as zeros
        self._zero_unwritten(bucket)
        bucket.launched = True
        bucket.handle = self._start_reduction(bucket)
        self._next_launch = bucket.index + 1
        if bucket.handle is None:
            self._complete(bucket)

    def _complete(self, bucket: Bucket) -> None:
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle = None
        bucket.reduced = True
        self._after_reduction(bucket)

    def _reap(self) -> None:
        """Finish the buckets whose collectives completed; without persistent storage also wait for all but
        the newest ``MAX_IN_FLIGHT`` launched, so backward never holds many reduced-but-unfreed buckets
        (some backends, gloo's reduce-scatter among them, report completion only once waited for)."""
        in_flight = [b for b in self.buckets[: self._next_launch] if b.handle is not None]
        for position, bucket in enumerate(in_flight):
            too_many = not self.persistent and position < len(in_flight) - self.MAX_IN_FLIGHT
            if too_many or bucket.handle.is_completed():
                self._complete(bucket)

    def finish_grad_sync(self) -> None:
        """Sum every bucket over the group (the loss is already normalised by the global token count):
        start the buckets backward did not, then wait for all."""
        for bucket in self.buckets[self._next_launch :]:
            self._launch(bucket)
        for bucket in self.buckets:
            if not bucket.reduced:
                self._complete(bucket)

    def reduced_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The summed gradient of ``param`` this rank holds after the reduction (all of it here)."""
        return param.main_grad

    def update_grads(self) -> list[torch.Tensor]:
        """The reduced gradients this rank updates parameters with (to unscale, check and clip); slots still
        unwritten (a step read without :meth:`finish_grad_sync`, one rank) are zeroed first."""
        if self.data is None:
            return []
        if self.unwritten:
            for bucket in self.buckets:
                self._zero_unwritten(bucket)
        return [self.data]


def reduction_group(expert: bool) -> tuple[Optional[dist.ProcessGroup], int]:
    """The group (and its size) a dense or expert parameter's gradient is summed over: every cp rank
    computes part of every gradient from its own tokens, so data parallel x context parallel."""
    if expert:
        return (
            ps.get_expert_data_parallel_group(with_context_parallel=True),
            ps.get_expert_data_parallel_world_size(with_context_parallel=True),
        )
    return ps.get_data_parallel_group(with_context_parallel=True), ps.get_data_parallel_world_size(True)


def split_by_group(params: list[torch.nn.Parameter]) -> dict[tuple[bool, torch.dtype], list[torch.nn.Parameter]]:
    """``params`` by (expert, dtype): one buffer each, in first-seen order (the same on every rank)."""
    groups: dict[tuple[bool, torch.dtype], list[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault((get_sharding(p).expert, p.dtype), []).append(p)
    return groups


class GradBuffers:
    """The gradient buffers of a model: per parameter dtype, dense (data-parallel group) and expert
    (expert-data-parallel group), each with the context-parallel ranks. ``buffer_cls`` and ``buffer_kwargs`` choose the reduction (ZeRO);
    ``group_for(expert)`` the group and its size (hybrid sharding: a shard group)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        bucket_size: int = 40_000_000,
        pad_for_zero: bool = False,
        overlap: bool = False,
        buffer_cls: type[GradBuffer] = GradBuffer,
        group_for: Callable[[bool], tuple[Optional[dist.ProcessGroup], int]] = reduction_group,
        **buffer_kwargs,
    ):
        trainable = [p for p in params if p.requires_grad]
        groups = split_by_group(trainable)
        self.buffers: list[GradBuffer] = []
        for (expert, _), members in groups.items():
            group, size = group_for(expert)
            self.buffers.append(
                buffer_cls(
                    members,
                    group,
                    bucket_size,
                    pad_to=size if pad_for_zero else 1,
                    own_bucket=is_shared_embedding if pad_for_zero else None,
                    **buffer_kwargs,
                )
            )
        self.buffer_of = {id(p): buffer for buffer in self.buffers for p in buffer.params}
        self.overlap = overlap
        self.in_last_backward = False  # inside the last micro-batch's backward: gradients are final
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in trainable]

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        buffer = self.buffer_of[id(param)]
        buffer.accumulate(param)
        if self.overlap and self.in_last_backward:
            buffer.grad_ready(param)

    @contextmanager
    def last_micro_batch_backward(self, active: bool = True) -> Iterator[None]:
        """Run the step's last backward through these parameters inside this block (``active=False``: a
        no-op; nested blocks keep the outer mark): with ``overlap`` the buckets start reducing from it.
        Announcing it is optional: without it the reductions all run in :meth:`finish_grad_sync`."""
        previous = self.in_last_backward
        self.in_last_backward = previous or active
        try:
            yield
        finally:
            self.in_last_backward = previous

    def zero(self) -> None:
        for buffer in self.buffers:
            buffer.zero()

    def finish_grad_sync(self) -> None:
        for buffer in self.buffers:
            buffer.finish_grad_sync()

    def reduced_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        return self.buffer_of[id(param)].reduced_grad(param)

    def update_grads(self) -> list[torch.Tensor]:
        return [g for buffer in self.buffers for g in buffer.update_grads()]

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
