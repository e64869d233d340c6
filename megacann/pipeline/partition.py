"""Which transformer layers live on which (virtual) pipeline stage, and building this rank's chunks."""

from __future__ import annotations

from typing import Optional, Union

import torch

from megacann import parallel_state as ps
from megacann.config import MegacannConfig
from megacann.models.spec import ChunkPlacement, ModelSpec, get_model_spec
from megacann.pipeline.overlap import LANE_ATTR
from megacann.pipeline.rules import V_SHAPED
from megacann.pipeline.split_backward import prepare_split_backward
from megacann.pipeline.v_schedules import v_chunk_segment


def stage_layer_ids(
    num_layers: int,
    pipeline_size: int,
    pipeline_rank: int,
    virtual_size: Optional[int] = None,
    virtual_rank: int = 0,
    pipeline_layers: Optional[list[int]] = None,
    v_shape: bool = False,
) -> list[int]:
    """Global layer indices held by model chunk ``virtual_rank`` of stage ``pipeline_rank``.

    Chunks are ordered as in interleaved 1F1B: chunk v of stage p is model segment v*pp + p; with
    ``v_shape`` (two chunks, the V-shaped schedules) chunk 0 of stage p is segment p and chunk 1 segment
    2pp - 1 - p. ``pipeline_layers`` lists the size of every segment in model order (pp x vpp entries);
    default: an even split.
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
    if v_shape:
        if vpp != 2:
            raise ValueError(f"the V placement holds two chunks per stage, got virtual_size {virtual_size}")
        segment = v_chunk_segment(pipeline_size, pipeline_rank, virtual_rank)
    start = sum(pipeline_layers[:segment])
    return list(range(start, start + pipeline_layers[segment]))


def chunk_placements(cfg: MegacannConfig, pipeline_rank: Optional[int] = None) -> list[ChunkPlacement]:
    """Where each model chunk of a pipeline stage sits (one chunk per virtual stage, two in the V of
    ``zbv`` and ``dualpipev``): its layers, and whether it holds the model's embedding (first chunk of
    stage 0) and head (last chunk of the last stage; in the V, chunk 1 of stage 0)."""
    d = cfg.distributed
    pp = d.pipeline_parallel_size
    stage = ps.get_pipeline_model_parallel_rank() if pipeline_rank is None else pipeline_rank
    v_shape = d.pipeline_schedule in V_SHAPED and pp > 1
    vpp = 2 if v_shape else d.virtual_pipeline_size or 1
    return [
        ChunkPlacement(
            tuple(stage_layer_ids(cfg.model.num_layers, pp, stage, vpp, chunk, d.pipeline_layers, v_shape)),
            pre_process=stage == 0 and chunk == 0,
            post_process=(stage == 0 and chunk == 1) if v_shape else (stage == pp - 1 and chunk == vpp - 1),
        )
        for chunk in range(vpp)
    ]


def build_model_chunks(
    cfg: MegacannConfig, spec: Optional[ModelSpec] = None, device: Optional[Union[torch.device, str]] = None
) -> list[torch.nn.Module]:
    """This rank's model chunks, built by the model family's spec (default: the recipe's ``model.type``);
    under a schedule that splits the backward, prepared for it (their products' weight gradients deferrable)."""
    spec = spec or get_model_spec(cfg.model.type)
    chunks = []
    for chunk, placement in enumerate(chunk_placements(cfg)):
        # chunk c's layers keep lane c's groups (megacann.pipeline.overlap); without lanes, the groups
        lane = chunk if ps.communication_lanes() > 1 else 0
        with ps.communication_lane(lane):
            chunks.append(spec.build(cfg, placement, device))
        setattr(chunks[-1], LANE_ATTR, lane)
    if cfg.distributed.splits_backward:
        prepare_split_backward(chunks)
    return chunks
