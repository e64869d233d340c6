"""Reading a step's device-side figures on the host, all at once.

A training step leaves its figures (loss, gradient norm, token count, a model's auxiliary losses and
stats) as tensors on the accelerator, so the host never waits for the device inside the step and keeps
queueing work. Whoever needs the numbers (logging, a test) calls :func:`to_host`: one device-to-host copy
per device, hence one synchronisation, instead of one per figure.
"""

from __future__ import annotations

from typing import Any

import torch


def to_host(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with every tensor replaced by a float (one element) or a list of floats (several);
    other values are kept. Tensors on one device are copied to the host together."""
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    by_device: dict[torch.device, list[str]] = {}
    for key, tensor in tensors.items():
        by_device.setdefault(tensor.device, []).append(key)
    out = dict(values)
    for keys in by_device.values():
        flat = torch.cat([tensors[k].detach().reshape(-1).double() for k in keys]).tolist()  # the one sync
        offset = 0
        for key in keys:
            size = tensors[key].numel()
            chunk = flat[offset : offset + size]
            out[key] = chunk[0] if size == 1 else chunk
            offset += size
    return out


def step_values_on_host(result: dict[str, Any]) -> dict[str, Any]:
    """A training step's figures as host numbers (one synchronisation); ``num_tokens`` an int."""
    values = to_host(result)
    values["num_tokens"] = int(values["num_tokens"])
    return values
