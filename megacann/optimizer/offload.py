"""``optim.offload_optimizer``: fp32 master weights and optimizer state in host memory, the update on the CPU.

The device keeps the model's weights and the fp32 gradient buffers (reduced and clipped there, as without
offload). Each step, :class:`HostUpdate` copies the gradients the update reads (all of them, or this rank's
ZeRO shard) into host staging buffers, runs the torch optimizer on host fp32 pieces, and the updated masters
are copied back into the model's weights (ZeRO: into this rank's owned ranges, then all-gathered as usual).
On a device with streams the host buffers are pinned and the copies non-blocking (one wait before the host
update); on CPU the "host" is the same memory and the copies only prove the path (their bytes are counted).

:class:`HostUpdate` knows nothing of sharding: it takes fp32 host masters and the device gradients that go
with them, so any optimizer (plain, ZeRO-1/2, a ZeRO-3 shard) can hand it its pieces;
:class:`OffloadedOptimizer` and :class:`OffloadedDistributedOptimizer` are the plain and ZeRO-1/2 ones.
Checkpoints see the host tensors through ``state_shards()`` like any other state (layout-free).
"""

from __future__ import annotations

from typing import Callable

import torch

from megacann.accelerator import get_accelerator
from megacann.config import MegacannConfig
from megacann.optimizer.optimizer import (
    MixedPrecisionOptimizer,
    build_inner_optimizer,
    init_optimizer_state,
    no_weight_decay,
)
from megacann.optimizer.zero import DistributedOptimizer
from megacann.optimizer.zero.layout import shard_slice


def state_keys_of(cfg: MegacannConfig) -> tuple[str, ...]:
    """The per-element state tensors the recipe's optimizer keeps (as ``state_keys`` of the built one)."""
    return ("momentum_buffer",) if cfg.optim.name == "sgd" else ("exp_avg", "exp_avg_sq")


StateView = Callable[[int, str], torch.Tensor]  # (piece index, state key) -> a host view for that state


class HostUpdate:
    """Host buffers and the host-side update of an optimizer's fp32 pieces.

    ``moved_to_host`` / ``moved_to_device`` count the bytes copied through this path (gradients down,
    updated fp32 masters up); :meth:`host_tensors` are the host buffers it allocated (masters, state,
    gradient staging), for memory accounting."""

    def __init__(self, device: torch.device):
        self.device = device
        self.streams = device.type != "cpu"  # pinned buffers and non-blocking copies
        self._host: list[torch.Tensor] = []
        self._grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host staging, device gradient)
        self.moved_to_host = 0
        self.moved_to_device = 0

    def zeros(self, numel: int) -> torch.Tensor:
        """A flat fp32 host buffer (pinned when the device has streams), registered as host memory."""
        out = torch.zeros(numel, dtype=torch.float32, pin_memory=self.streams)
        self._host.append(out)
        return out

    def host_tensors(self) -> list[torch.Tensor]:
        return list(self._host)

    def build(
        self,
        cfg: MegacannConfig,
        masters: list[torch.Tensor],
        grads: list[torch.Tensor],
        decays: list[bool],
        state_view: StateView,
    ) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
        """The inner torch optimizer over host ``masters`` (views of buffers from :meth:`zeros`), whose
        ``.grad`` are host copies of the device ``grads`` (same element count each), refreshed before every
        step; its state tensors are ``state_view(i, key)``. Returns it and its pieces (in the order of ``masters``)."""
        staging = self.zeros(sum(m.numel() for m in masters))
        pieces, offset = [], 0
        for master, grad in zip(masters, grads):
            if master.numel() != grad.numel():
                raise ValueError(f"a host master of {master.numel()} elements for a gradient of {grad.numel()}")
            piece = torch.nn.Parameter(master)  # shares the host buffer's storage
            piece.grad = staging[offset : offset + master.numel()].view(master.shape)
            self._grads.append((piece.grad, grad))
            pieces.append(piece)
            offset += master.numel()
        optimizer = build_inner_optimizer(pieces, cfg, decays)
        index = {id(p): i for i, p in enumerate(pieces)}
        init_optimizer_state(optimizer, lambda p, key: state_view(index[id(p)], key))
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.fetch_grads())
        return optimizer, pieces

    @torch.no_grad()
    def fetch_grads(self) -> None:
        """Copy the (reduced, unscaled, clipped) device gradients into the host staging buffers."""
        for host, grad in self._grads:
            host.copy_(grad.view(host.shape), non_blocking=self.streams)
            self.moved_to_host += host.numel() * host.element_size()
        self.wait()

    @torch.no_grad()
    def push(self, destination: torch.Tensor, master: torch.Tensor) -> None:
        """Copy an updated host master into device memory (cast to the destination's dtype)."""
        destination.copy_(master.view(destination.shape), non_blocking=self.streams)
        self.moved_to_device += master.numel() * master.element_size()

    def wait(self) -> None:
        """Wait for the copies in flight (none on CPU)."""
        if self.streams:
            get_accelerator(self.device.type).synchronize()


class OffloadedOptimizer(MixedPrecisionOptimizer):
    """:class:`MixedPrecisionOptimizer` with every fp32 master (fp32 weights get a host copy too) and the
    optimizer state in host memory; nothing of the optimizer's is allocated on the device."""

    def _build_update(self, cfg: MegacannConfig) -> None:
        params = self.model_params
        device = params[0].device if params else torch.device("cpu")
        self.offload = HostUpdate(device)
        sizes = [p.numel() for p in params]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        flat = self.offload.zeros(sum(sizes))
        masters = [flat[s : s + p.numel()].view(p.shape) for s, p in zip(starts, params)]
        with torch.no_grad():
            for master, p in zip(masters, params):
                master.copy_(p.detach(), non_blocking=self.offload.streams)
        self.offload.wait()
        states = {key: self.offload.zeros(sum(sizes)) for key in state_keys_of(cfg)}

        def state_view(i: int, key: str) -> torch.Tensor:
            return states[key][starts[i] : starts[i] + sizes[i]].view(params[i].shape)

        decays = [not no_weight_decay(p) for p in params]
        grads = [p.main_grad for p in params]
        self.optimizer, self.master_params = self.offload.build(cfg, masters, grads, decays, state_view)

    @torch.no_grad()
    def _copy_master_to_model(self) -> None:
        for param, master in zip(self.model_params, self.master_params):
            self.offload.push(param.data, master)

    def state_shards(self):
        """As without offload; an fp32 weight's host master is left out (the weight is saved and loaded as the
        master, so checkpoints are those of a run without offload, and loading needs no copy aside)."""
        self.offload.wait()  # no copy in flight reads a master a checkpoint is about to overwrite
        shards = super().state_shards()
        for shard in shards:
            if shard.param.dtype == torch.float32:
                del shard.tensors["master"]
        return shards

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """After a load: fp32 weights are the truth (their host masters take them), others take their masters."""
        for param, master in zip(self.model_params, self.master_params):
            if param.dtype == torch.float32:
                master.copy_(param.detach())
            else:
                self.offload.push(param.data, master)
        self.offload.wait()


class OffloadedDistributedOptimizer(DistributedOptimizer):
    """ZeRO-1/2 with this rank's fp32 master shard and optimizer state shard in host memory. Gradients are
    reduce-scattered on the device as usual; only this rank's shard of them is copied to the host."""

    def _build_inner_optimizer(self, cfg: MegacannConfig) -> None:
        device = self.shards[0].buffer.device if self.shards else torch.device("cpu")
        self.offload = HostUpdate(device)
        keys = state_keys_of(cfg)
        masters, grads, decays, slots = [], [], [], []
        for shard in self.shards:
            host = self.offload.zeros(shard.buffer.shard_numel)
            with torch.no_grad():
                if shard.master is not None:
                    host.copy_(shard.master)
                else:  # fp32: the masters were the parameters' own owned ranges
                    for bucket in shard.buffer.buckets:
                        host[shard_slice(bucket, shard.buffer.group_size)].copy_(shard.params.owned(bucket))
            shard.master = host  # the device copy (bf16 / fp16 weights) is freed here
            shard.states = {k: self.offload.zeros(shard.buffer.shard_numel) for k in keys}
            for r in shard.ranges:
                masters.append(shard.master_view(r))
                grads.append(shard.buffer.reduced_grad(r.param))
                decays.append(not no_weight_decay(r.param))
                slots.append((shard, r))
        if not masters:
            raise ValueError(
                f"data-parallel rank owns no parameter elements under ZeRO ({len(self.model_params)} trainable "
                "parameters): use fewer data-parallel ranks or zero_optimization: false"
            )

        def state_view(i: int, key: str) -> torch.Tensor:
            shard, r = slots[i]
            return shard.states[key][r.shard_start : r.shard_start + r.numel]

        self.optimizer, pieces = self.offload.build(cfg, masters, grads, decays, state_view)
        self.pieces = [(shard, r, piece) for (shard, r), piece in zip(slots, pieces)]

    @torch.no_grad()
    def _copy_master_to_model(self) -> None:
        """Copy the updated host shard into this rank's owned ranges, then all-gather as ZeRO does."""
        for shard in self.shards:
            size = shard.buffer.group_size
            for bucket in shard.buffer.buckets:
                self.offload.push(shard.params.owned(bucket), shard.master[shard_slice(bucket, size)])
            shard.params.gather(async_op=True)
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def state_shards(self):
        """As ZeRO's; with fp32 weights the host master is left out (see :meth:`OffloadedOptimizer.state_shards`)."""
        self.offload.wait()
        shards = super().state_shards()
        fp32 = {id(r.param) for shard in self.shards if shard.params.data.dtype == torch.float32 for r in shard.ranges}
        for shard in shards:
            if id(shard.param) in fp32:
                del shard.tensors["master"]
        return shards

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """After a load: fp32 weights (whole on every rank) are the truth, so the host shard takes this rank's
        ranges of them; low-precision weights take the loaded masters and are gathered."""
        for shard in self.shards:
            if shard.params.data.dtype == torch.float32:
                for bucket in shard.buffer.buckets:
                    shard.master[shard_slice(bucket, shard.buffer.group_size)].copy_(shard.params.owned(bucket))
        super().reload_model_params()
