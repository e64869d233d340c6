"""Model parameters in flat buffers laid out like their gradient buffer, all-gathered after ZeRO updates.

Each trainable parameter's ``.data`` becomes a view of one flat tensor (the model's dtype) with the
layout of its gradient buffer, so after every data-parallel rank has written its updated range, one
in-place all-gather per bucket gives every rank the whole model. With ``overlap_param_gather`` the
gathers run asynchronously after the optimizer step, launched in forward order, and
:class:`ForwardGatherHooks` waits for a bucket only when a module that uses it is about to run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megacann.collectives import all_gather_flat
from megacann.optimizer.grad_buffer import Bucket, GradBuffer
from megacann.optimizer.zero.layout import owned_range


class ParamBuffer:
    """The parameters of ``grad_buffer`` moved into one flat tensor; ``rank`` of ``size`` owns ranges."""

    def __init__(self, grad_buffer: GradBuffer, rank: int):
        self.grad_buffer = grad_buffer
        self.rank, self.size = rank, grad_buffer.group_size
        dtypes = {p.dtype for p in grad_buffer.params}
        if len(dtypes) > 1:
            raise ValueError(f"a parameter buffer holds one dtype, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop() if dtypes else torch.float32
        self.dtype = dtype
        self.data = torch.zeros(grad_buffer.numel, dtype=dtype, device=grad_buffer.device)
        with torch.no_grad():
            for p in grad_buffer.params:
                start, end = grad_buffer.ranges[id(p)]
                view = self.data[start:end].view(p.shape)
                view.copy_(p.detach())
                p.data = view  # the model now reads and writes the flat buffer
        self.handles: dict[int, dist.Work] = {}  # bucket index -> all-gather in flight

    def owned(self, bucket: Bucket) -> torch.Tensor:
        """This rank's range of ``bucket`` (what its optimizer updates)."""
        start, end = owned_range(bucket, self.rank, self.size)
        return self.data[start:end]

    def master_view(self, buffer_start: int, shard_start: int, numel: int) -> torch.Tensor:
        """fp32 weights are their own masters: the owned elements of the flat buffer."""
        return self.data[buffer_start : buffer_start + numel]

    def gather(self, async_op: bool) -> None:
        """All-gather every bucket in place, last bucket first (the forward's order)."""
        if self.size == 1:
            return
        for bucket in reversed(self.grad_buffer.buckets):
            out = self.data[bucket.start : bucket.end]
            handle = all_gather_flat(out, self.owned(bucket), self.grad_buffer.group, async_op=async_op)
            if handle is not None:
                self.handles[bucket.index] = handle

    def wait(self, params: Optional[Iterable[torch.nn.Parameter]] = None) -> None:
        """Wait for the gathers of the buckets holding ``params`` (default: all)."""
        if not self.handles:
            return
        if params is None:
            indices = list(self.handles)
        else:
            bucket_of = self.grad_buffer.bucket_of
            indices = [bucket_of[id(p)].index for p in params if id(p) in bucket_of]
        for index in indices:
            handle = self.handles.pop(index, None)
            if handle is not None:
                handle.wait()


WaitFn = Callable[[Optional[list[torch.nn.Parameter]]], None]


class ForwardGatherHooks:
    """Forward pre-hooks that wait for the parameters a module is about to use.

    A module waits for its own parameters. Some parameters are used by an ancestor without their own
    module ever running (the output layer's weight read by the model's head); which ones is learnt in
    the first forward of each root (nothing is in flight then: gathers start after the first step), and
    from then on the root's pre-hook waits for them. Saving a ``state_dict`` waits for everything.
    """

    def __init__(self, roots: list[torch.nn.Module], params: Iterable[torch.nn.Parameter], wait: WaitFn):
        self.wait = wait
        wanted = {id(p) for p in params}
        self.direct: dict[int, list[torch.nn.Parameter]] = {}
        self.uncalled: dict[int, Optional[list[torch.nn.Parameter]]] = {}  # root id -> None until learnt
        self._seen: set[int] = set()
        self._handles = []
        owned: set[int] = set()
        for root in roots:
            self.uncalled[id(root)] = None
            for module in root.modules():
                mine = [p for p in module.parameters(recurse=False) if id(p) in wanted and id(p) not in owned]
                owned.update(id(p) for p in mine)
                if mine:
                    self.direct[id(module)] = mine
                    if module is not root:
                        self._handles.append(module.register_forward_pre_hook(self._module_pre))
            self._handles.append(root.register_forward_pre_hook(self._root_pre))
            self._handles.append(root.register_forward_hook(self._root_post))
            self._handles.append(root.register_state_dict_pre_hook(self._before_state_dict))
        self._roots = roots

    def _module_pre(self, module: torch.nn.Module, args) -> None:
        self._seen.add(id(module))
        self.wait(self.direct[id(module)])

    def _root_pre(self, root: torch.nn.Module, args) -> None:
        uncalled = self.uncalled[id(root)]
        if uncalled is None:  # not learnt yet: be safe
            self.wait([p for p in root.parameters()])
            self._seen.add(id(root))
            return
        self.wait(self.direct.get(id(root), []) + uncalled)

    def _root_post(self, root: torch.nn.Module, args, output) -> None:
        if self.uncalled[id(root)] is None:
            self.uncalled[id(root)] = [
                p
                for m in root.modules()
                if id(m) not in self._seen and m is not root
                for p in self.direct.get(id(m), [])
            ]

    def _before_state_dict(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        self.wait(None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
