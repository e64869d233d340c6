"""Bytes an optimizer holds on this rank, measured from the tensors' storages (not from formulas).

Each storage is counted once, under the first heading that reaches it: parameters, then gradients, then
optimizer state. So fp32 master weights that *are* the parameters (fp32 training) count as parameters,
and the optimizer-state figure is what the optimizer adds on top: fp32 masters of low-precision
parameters and Adam's two moments, for all parameters (plain) or this rank's shard (ZeRO, padding
included). ZeRO-2's full-size bucket storage counts as gradients only while it is allocated; ZeRO-3's
weights count as this rank's shard plus whatever buckets are gathered at the time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch

from megacann.optimizer.optimizer import OptimizerBase


def _storages(tensors: Iterable[Optional[torch.Tensor]]) -> dict[int, int]:
    found = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Total bytes of the distinct storages behind ``tensors``."""
    return sum(_storages(tensors).values())


def grad_tensors(optimizer: OptimizerBase) -> list[torch.Tensor]:
    """Every gradient storage the optimizer's buffers hold now (full buffers, ZeRO-2 shards and buckets)."""
    tensors = []
    for buffer in optimizer.grad_buffers.buffers:
        tensors.append(buffer.data)
        tensors.append(getattr(buffer, "shard", None))
        tensors.extend(bucket.data for bucket in buffer.buckets)
    return [t for t in tensors if t is not None]


def optimizer_memory(optimizer: OptimizerBase) -> dict[str, int]:
    """{"params", "grads", "optimizer_states", "host"}: bytes held for the trainable parameters on this rank;
    "host" is what ``optim.offload_optimizer`` keeps in host memory (fp32 masters, state, gradient staging),
    left out of the other headings (on CPU the host is the same memory, so only this tells them apart)."""
    offload = getattr(optimizer, "offload", None)
    host = _storages(offload.host_tensors()) if offload is not None else {}
    params = _storages(optimizer.param_tensors())
    grads = {k: v for k, v in _storages(grad_tensors(optimizer)).items() if k not in params}
    state_tensors = [t for shard in optimizer.state_shards() for t in shard.tensors.values()]
    states = {k: v for k, v in _storages(state_tensors).items() if k not in params and k not in grads and k not in host}
    return {
        "params": sum(params.values()),
        "grads": sum(grads.values()),
        "optimizer_states": sum(states.values()),
        "host": sum(host.values()),
    }
