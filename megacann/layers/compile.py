"""``torch.compile`` per transformer block.

Compiling block by block (rather than the whole model) keeps what is hard to trace out of the graph: the
pipeline schedule, the chunked head loss, gradient hooks, activation checkpointing (recompute wraps the
compiled block, see :meth:`TransformerBlock.compile_forward`). Identical blocks share one compiled graph:
their parameters are graph inputs, so an L-layer model compiles once, not L times.

The ops a block calls (:mod:`megacann.ops`) are resolved before compiling, because choosing an
implementation may import packages or build kernels, which cannot be traced.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

import torch

from megacann import ops
from megacann.layers.transformer import TransformerBlock

DEFAULT_BACKEND = "inductor"  # torch.compile's own default: generated Triton (GPU) / C++ (CPU) kernels


def available_backends() -> list[str]:
    """The ``torch.compile`` backends this torch knows (debug ones included, e.g. ``aot_eager``)."""
    import torch._dynamo

    return sorted(set(torch._dynamo.list_backends(exclude_tags=())) | {DEFAULT_BACKEND})


def compile_blocks(
    modules: Union[torch.nn.Module, Iterable[torch.nn.Module]], backend: str = DEFAULT_BACKEND, **kwargs: Any
) -> list[str]:
    """Compile every :class:`TransformerBlock` inside ``modules`` (a model or a list of model chunks) with
    ``torch.compile(backend=backend, **kwargs)``. Returns the compiled blocks' names; raises ValueError
    when there is none, so a request to compile never passes silently."""
    chunks = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    blocks = [
        (f"{index}.{name}" if len(chunks) > 1 else name, module)
        for index, chunk in enumerate(chunks)
        for name, module in chunk.named_modules()
        if isinstance(module, TransformerBlock)
    ]
    if not blocks:
        kinds = sorted({type(chunk).__name__ for chunk in chunks})
        raise ValueError(
            f"compile_blocks compiles megacann.layers.TransformerBlock modules, and {kinds} holds none: "
            "build the model's layers from TransformerBlock, or compile it yourself"
        )
    device_types = {p.device.type for chunk in chunks for p in chunk.parameters()} or {"cpu"}
    for device_type in sorted(device_types):
        ops.selection(device_type)  # resolve every op now: resolving is not traceable
    for _, block in blocks:
        block.compile_forward(backend=backend, **kwargs)
    return [name for name, _ in blocks]
