"""Which transformer layers live on which (virtual) pipeline stage."""

from __future__ import annotations

from typing import Optional


def stage_layer_ids(
    num_layers: int,
    pipeline_size: int,
    pipeline_rank: int,
    virtual_size: Optional[int] = None,
    virtual_rank: int = 0,
    pipeline_layers: Optional[list[int]] = None,
) -> list[int]:
    """Global layer indices held by model chunk ``virtual_rank`` of stage ``pipeline_rank``.

    Chunks are ordered as in interleaved 1F1B: chunk v of stage p is model segment v*pp + p.
    ``pipeline_layers`` lists the size of every segment (pp x vpp entries); default: an even split.
    """
    vpp = virtual_size or 1
    segments = pipeline_size * vpp
    if pipeline_layers is None:
        if num_layers % segments:
            raise ValueError(f"num_layers {num_layers} is not divisible by pipeline stages x virtual stages {segments}")
        pipeline_layers = [num_layers // segments] * segments
    if len(pipeline_layers) != segments or sum(pipeline_layers) != num_layers:
        raise ValueError(f"pipeline_layers {pipeline_layers} must list {segments} sizes summing to {num_layers}")
    segment = virtual_rank * pipeline_size + pipeline_rank
    start = sum(pipeline_layers[:segment])
    return list(range(start, start + pipeline_layers[segment]))
