"""Activation offload (``training.activation_offload_layers``): what chosen transformer layers save for
backward goes to host memory during the forward and comes back when their backward needs it.

Built on ``torch.autograd.graph.saved_tensors_hooks``, entered around each chosen layer's forward: every
storage an op of the layer saves (parameters excepted: they stay on the device anyway) is copied to host
memory once per forward, and each unpack copies it back. On a device with streams the host buffers are
pinned and the copies non-blocking (ordered on the stream that computes); on CPU the host is the same
memory and the copies only prove the path (:attr:`ActivationOffload.moved_to_host` counts them).

Selective recompute composes (the attention core's checkpoint keeps its own tensors; the rest of the
layer is offloaded); full recompute keeps only each layer's input, held by the checkpoint outside
autograd's saved tensors, so the recipe refuses that pair (``megacann.config.offload_keys``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)$")


class _HostCopy:
    """One saved storage in host memory; brought back to the device once for all the tensors viewing it."""

    __slots__ = ("host", "device", "pending", "restored", "owner")

    def __init__(self, owner: ActivationOffload, host: torch.Tensor, device: torch.device):
        self.owner, self.host, self.device = owner, host, device
        self.pending, self.restored = 0, None  # packs not unpacked yet; the device copy while some are
        owner.host_live += host.numel()
        owner.host_peak = max(owner.host_peak, owner.host_live)

    def __del__(self) -> None:
        self.owner.host_live -= self.host.numel()


class _Saved:
    """A saved tensor: its storage's host copy and how the tensor views that storage."""

    __slots__ = ("copy", "dtype", "shape", "stride", "offset")

    def __init__(self, copy: _HostCopy, tensor: torch.Tensor):
        self.copy, self.dtype = copy, tensor.dtype
        self.shape, self.stride, self.offset = tensor.shape, tensor.stride(), tensor.storage_offset()
        copy.pending += 1


class ActivationOffload:
    """The offload of a set of layers: hooks, host copies and the byte counters.

    ``moved_to_host``: bytes copied to the host (each saved storage once per layer forward);
    ``moved_to_device``: bytes copied back (each storage once per backward); ``host_live`` / ``host_peak``:
    bytes of host copies alive now / at most; ``layers``: how many modules it wraps."""

    def __init__(self) -> None:
        self.moved_to_host = 0
        self.moved_to_device = 0
        self.host_live = 0
        self.host_peak = 0
        self.layers = 0
        self._exclude: set[int] = set()
        self._has_device = False  # the layer computes on an accelerator (CPU tensors are then left alone)
        self._copies: dict[int, tuple[_HostCopy, torch.Tensor]] = {}  # storage -> host copy, in one layer's forward

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._exclude or storage.nbytes() == 0 or (tensor.device.type == "cpu" and self._has_device):
            return tensor  # parameters, shared inputs, empty tensors, and what is on the host already
        copy, _ = self._copies.get(ptr, (None, None))
        if copy is None:
            streams = tensor.device.type != "cpu"
            raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),))
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=streams)
            host.copy_(raw, non_blocking=streams)
            copy = _HostCopy(self, host, tensor.device)
            # the device storage stays referenced until the layer's forward ends: its address cannot be reused
            # by a later tensor of this forward and mistaken for it
            self._copies[ptr] = (copy, tensor)
            self.moved_to_host += storage.nbytes()
        return _Saved(copy, tensor)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        copy = saved.copy
        if copy.restored is None:
            streams = copy.device.type != "cpu"
            copy.restored = copy.host.to(copy.device, non_blocking=streams, copy=True)
            self.moved_to_device += copy.host.numel()
        raw = copy.restored
        copy.pending -= 1
        if copy.pending <= 0:  # the tensors handed out keep the storage alive as long as autograd needs it
            copy.restored = None
        return raw.view(saved.dtype).as_strided(saved.shape, saved.stride, saved.offset)

    def wrap(self, module: torch.nn.Module) -> None:
        """Offload what ``module``'s forward saves (when autograd records it)."""
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            params = list(module.parameters())
            self._exclude = {p.untyped_storage().data_ptr() for p in params}  # ZeRO may have moved them
            # inputs autograd does not differentiate (rotary tables, position ids) are shared by every layer
            inputs = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (tuple, list)) else (a,))]
            self._exclude |= {
                t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor) and not t.requires_grad
            }
            self._has_device = any(p.device.type != "cpu" for p in params)
            self._copies = {}
            try:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    return inner(*args, **kwargs)
            finally:
                self._copies = {}

        module.forward = forward
        self.layers += 1


def offload_layer_activations(chunks: Iterable[torch.nn.Module], layer_ids: Iterable[int]) -> ActivationOffload:
    """Offload the activations of the transformer layers with these global indices that ``chunks`` hold
    (modules named ``layers.<i>``, as megacann's decoder names them); returns the offload and its counters."""
    wanted = set(layer_ids)
    offload = ActivationOffload()
    for chunk in chunks:
        for name, module in chunk.named_modules():
            match = _LAYER_NAME.search(name)
            if match and int(match.group(1)) in wanted:
                offload.wrap(module)
    return offload
